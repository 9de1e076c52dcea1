"""gpt-oss: what the layers below the models know of it (the model is `models/gpt_oss.py`).

GGUF (`gpt-oss`): layers alternate sliding / full starting with sliding; YaRN with beta_fast 32,
beta_slow 1, no truncation of the correction range (as the model's own config.json); clamped
SwiGLU with alpha 1.702 and limit 7.0. Experts are stored as separate gate / up / down stacks in
ggml's [out, in] layout (or a fused gate_up stack, gate half first); HF keeps `gate_up_proj`
[E, H, 2I] with gate and up interleaved on the last axis (gate at even indices), `down_proj`
[E, I, H], and the biases alike.
"""

from __future__ import annotations

from collections.abc import Collection

from freetoken.errors import ModelLoadError
from freetoken.families.base import (
    ATTENTION,
    EXPERTS_TRANSPOSE,
    FULL,
    INTERLEAVE,
    SLIDING,
    Family,
    GGUFFacts,
    HFFacts,
    layers_of,
)
from freetoken.families.gguf_keys import Keys

SWIGLU_ALPHA = 1.702
SWIGLU_LIMIT = 7.0

TENSORS: dict[str, str] = {
    **ATTENTION,
    "attn_norm.weight": "input_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "attn_sinks.weight": "self_attn.sinks",
    "ffn_gate_inp.weight": "mlp.router.weight",
    "ffn_gate_inp.bias": "mlp.router.bias",
    "ffn_down_exps.weight": "mlp.experts.down_proj",
    "ffn_down_exps.bias": "mlp.experts.down_proj_bias",
    "ffn_gate_exps.weight": "mlp.experts.gate_up_proj",
    "ffn_up_exps.weight": "mlp.experts.gate_up_proj",
    "ffn_gate_up_exps.weight": "mlp.experts.gate_up_proj",
    "ffn_gate_exps.bias": "mlp.experts.gate_up_proj_bias",
    "ffn_up_exps.bias": "mlp.experts.gate_up_proj_bias",
    "ffn_gate_up_exps.bias": "mlp.experts.gate_up_proj_bias",
}


def translate(k: Keys, cfg: dict[str, object], tensor_names: Collection[str]) -> None:
    layers = layers_of(cfg)
    rope: dict[str, object] = {"rope_type": "default", "rope_theta": k.positive("rope.freq_base", 150_000.0)}
    if k.raw("rope.scaling.type", None) == "yarn":
        rope.update(
            rope_type="yarn",
            factor=k.positive("rope.scaling.factor"),
            original_max_position_embeddings=k.count("rope.scaling.original_context_length", 4096),
            beta_fast=32.0,
            beta_slow=1.0,
            truncate=False,
        )
    cfg.update(
        intermediate_size=k.integer("expert_feed_forward_length", k.integer("feed_forward_length", 0)),
        head_dim=k.count("attention.key_length"),
        num_local_experts=k.count("expert_count"),
        num_experts_per_tok=k.count("expert_used_count"),
        hidden_act="silu",
        rope_parameters=rope,
        attention_bias=True,
        sliding_window=k.count("attention.sliding_window"),
        layer_types=[SLIDING if i % 2 == 0 else FULL for i in range(layers)],
        swiglu_alpha=SWIGLU_ALPHA,
        swiglu_limit=SWIGLU_LIMIT,
    )
    if cfg["intermediate_size"] < 1:  # type: ignore[operator]
        raise ModelLoadError("GGUF metadata lacks gpt-oss.expert_feed_forward_length")


def layout(rest: str) -> str | None:
    return EXPERTS_TRANSPOSE if rest.endswith("_exps.weight") else None


FAMILY = Family(
    name="gpt_oss",
    model_types=("gpt_oss",),
    hf=HFFacts(default_context=131_072, default_window=128),
    gguf=GGUFFacts(
        arch="gpt-oss",
        model_type="gpt_oss",
        hf_class="GptOssForCausalLM",
        translate=translate,
        tensors=TENSORS,
        layout=layout,
        experts_join=INTERLEAVE,
        window=True,
    ),
    tool_parser="harmony",
)
