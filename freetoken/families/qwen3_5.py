"""Qwen3.5 (dense hybrid): what the layers below the models know of it (the model is
`models/qwen3_5.py`).

GGUF (`qwen35`): linear-attention (Gated DeltaNet) layers where `attention.recurrent_layers` says
(else every `full_attention_interval`-th layer is full attention), their shape from the `ssm.*`
keys, rope over `rope.dimension_count` of each head (partial rotary). llama.cpp's converter
stores the `(1 + w)` norms as `1 + w` (the linear layers' gated `ssm_norm`, which multiplies by w,
as it is), `ssm_a` as -exp(A_log), the conv kernel as [C, K]; where key heads are fewer than value
heads it reorders the value heads from grouped by key head to tiled (the v rows of `attn_qkv`,
`attn_gate`, the `ssm_alpha` / `ssm_beta` rows, `ssm_a`, `ssm_dt`, the conv's v channels, the
`ssm_out` columns). Each tensor's rearrangement back is named here, done in `weights/names.py`.
A multimodal `config.json` (`qwen3_5`) holds the text model in `text_config`.
"""

from __future__ import annotations

from collections.abc import Collection

from freetoken.families import qwen3
from freetoken.families.base import (
    FULL,
    LINEAR_A_LOG,
    LINEAR_CONV,
    LINEAR_QKV_ROWS,
    LINEAR_V_COLUMNS,
    LINEAR_V_ROWS,
    LINEAR_V_SCALARS,
    NORM_MINUS_ONE,
    Family,
    GGUFFacts,
    HFFacts,
    layers_of,
)
from freetoken.families.gguf_keys import Keys

LINEAR = "linear_attention"

TENSORS: dict[str, str] = {
    **qwen3.TENSORS,
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ssm_a": "linear_attn.A_log",
    "ssm_conv1d.weight": "linear_attn.conv1d.weight",
    "ssm_dt.bias": "linear_attn.dt_bias",
    "ssm_alpha.weight": "linear_attn.in_proj_a.weight",
    "ssm_beta.weight": "linear_attn.in_proj_b.weight",
    "attn_qkv.weight": "linear_attn.in_proj_qkv.weight",
    "attn_gate.weight": "linear_attn.in_proj_z.weight",
    "ssm_norm.weight": "linear_attn.norm.weight",
    "ssm_out.weight": "linear_attn.out_proj.weight",
}

_LAYOUT = {
    "ssm_a": LINEAR_A_LOG,
    "ssm_conv1d.weight": LINEAR_CONV,
    "attn_qkv.weight": LINEAR_QKV_ROWS,
    "attn_gate.weight": LINEAR_V_ROWS,
    "ssm_alpha.weight": LINEAR_V_SCALARS,
    "ssm_beta.weight": LINEAR_V_SCALARS,
    "ssm_dt.bias": LINEAR_V_SCALARS,
    "ssm_out.weight": LINEAR_V_COLUMNS,
}


def norm_layout(rest: str) -> str | None:
    """The `(1 + w)` norms, stored as `1 + w`: every norm but the gated `ssm_norm` (Qwen3-Next's too)."""
    return NORM_MINUS_ONE if rest.endswith("norm.weight") and rest != "ssm_norm.weight" else None


def layout(rest: str) -> str | None:
    return _LAYOUT.get(rest) or norm_layout(rest)


def translate(k: Keys, cfg: dict[str, object], tensor_names: Collection[str]) -> None:
    """The hybrid's keys (Qwen3.5-MoE's too: `qwen3_5_moe.translate` adds its experts)."""
    layers = layers_of(cfg)
    head_dim = k.count("attention.key_length")
    recurrent = k.raw("attention.recurrent_layers", None)
    if isinstance(recurrent, (list, tuple)) and len(recurrent) >= layers:
        layer_types = [LINEAR if bool(r) else FULL for r in list(recurrent)[:layers]]
    else:
        interval = k.count("full_attention_interval", 4)
        layer_types = [FULL if (i + 1) % interval == 0 else LINEAR for i in range(layers)]
    value_heads = k.count("ssm.time_step_rank")
    cfg.update(
        intermediate_size=k.integer("feed_forward_length", 0),
        head_dim=head_dim,
        hidden_act="silu",
        attention_bias=False,
        layer_types=layer_types,
        sliding_window=None,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": k.positive("rope.freq_base", 10_000_000.0),
            "partial_rotary_factor": k.count("rope.dimension_count", head_dim // 4) / head_dim,
        },
        linear_conv_kernel_dim=k.count("ssm.conv_kernel"),
        linear_key_head_dim=k.count("ssm.state_size"),
        linear_num_key_heads=k.count("ssm.group_count"),
        linear_num_value_heads=value_heads,
        linear_value_head_dim=k.count("ssm.inner_size") // value_heads,
    )


FAMILY = Family(
    name="qwen3_5",
    model_types=("qwen3_5", "qwen3_5_text"),
    hf=HFFacts(default_context=32_768, default_window=None, nested="qwen3_5"),
    gguf=GGUFFacts(
        arch="qwen35",
        model_type="qwen3_5_text",
        hf_class="Qwen3_5ForCausalLM",
        translate=translate,
        tensors=TENSORS,
        layout=layout,
        uniform_heads=False,  # the q rows hold the output gate too: checked when the weights are loaded
    ),
    tensor_parallel=None,  # no shard plan: the linear layers' recurrent states
)
