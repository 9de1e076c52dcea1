"""Gemma 4: what the layers below the models know of it (the model is `models/gemma4.py`).

GGUF (`gemma4`): the per-layer `attention.sliding_window_pattern` (true = sliding) and
`attention.head_count_kv`; `key_length` is the full layers' head_dim, `key_length_swa` the
sliding ones'; rope `freq_base` on full layers (proportional, a quarter of the pairs turning: the
converter's `rope_freqs` tensor says so but is not read), `freq_base_swa` (default 10000) on
sliding ones; a full layer without `attn_v` reuses its keys as values (`attention_k_eq_v`);
experts when the file has `ffn_gate_inp`. Gemma 3's tensor names plus the second MLP norms, the
layer scalar (`layer_output_scale`), the router's scales (`ffn_gate_inp.scale`,
`ffn_down_exps.scale`) and the experts, whose gate / up stacks are fused or join gate rows first;
no norm shift (Gemma 4's norms multiply by w). Head sizes differ per layer kind, so the shapes are
checked at load. A `config.json` without a context or window means Gemma4TextConfig's 131072 and
512; a multimodal one (model_type "gemma4") holds the text model in `text_config`.
"""

from __future__ import annotations

from collections.abc import Collection

from freetoken.errors import ModelLoadError
from freetoken.families import gemma3
from freetoken.families.base import FULL, ROWS, SLIDING, Family, GGUFFacts, HFFacts, layers_of
from freetoken.families.gguf_keys import Keys

PARTIAL_ROTARY = 0.25
SWA_ROPE_BASE = 10_000.0

TENSORS: dict[str, str] = {
    **gemma3.TENSORS,
    "pre_ffw_norm_2.weight": "pre_feedforward_layernorm_2.weight",
    "post_ffw_norm_1.weight": "post_feedforward_layernorm_1.weight",
    "post_ffw_norm_2.weight": "post_feedforward_layernorm_2.weight",
    "layer_output_scale.weight": "layer_scalar",
    "ffn_gate_inp.weight": "router.proj.weight",
    "ffn_gate_inp.scale": "router.scale",
    "ffn_down_exps.scale": "router.per_expert_scale",
    "ffn_gate_up_exps.weight": "experts.gate_up_proj",
    "ffn_gate_exps.weight": "experts.gate_up_proj",
    "ffn_up_exps.weight": "experts.gate_up_proj",
    "ffn_down_exps.weight": "experts.down_proj",
}


def translate(k: Keys, cfg: dict[str, object], tensor_names: Collection[str]) -> None:
    layers = layers_of(cfg)
    if k.integer("embedding_length_per_layer_input", 0) or k.integer("attention.shared_kv_layers", 0):
        raise ModelLoadError("gemma4 with per-layer embeddings or shared KV layers (Gemma 4 E2B/E4B) is not supported")
    sliding = [bool(flag) for flag in k.per_layer("attention.sliding_window_pattern", layers)]
    k.count("attention.head_count_kv")  # every entry a positive integer
    kv_heads = [int(h) for h in k.per_layer("attention.head_count_kv", layers)]  # type: ignore[call-overload]
    full = [i for i in range(layers) if not sliding[i]]
    swa = [i for i in range(layers) if sliding[i]]
    moe = any(f"blk.{i}.ffn_gate_inp.weight" in tensor_names for i in range(layers))
    cfg.update(
        intermediate_size=k.count("feed_forward_length"),
        head_dim=k.count("attention.key_length_swa", k.integer("attention.key_length")),
        global_head_dim=k.count("attention.key_length"),
        num_key_value_heads=kv_heads[swa[0]] if swa else kv_heads[0],
        num_global_key_value_heads=kv_heads[full[0]] if full else None,
        attention_k_eq_v=any(f"blk.{i}.attn_v.weight" not in tensor_names for i in full),
        hidden_activation="gelu_pytorch_tanh",
        rope_parameters={
            SLIDING: {"rope_type": "default", "rope_theta": k.positive("rope.freq_base_swa", SWA_ROPE_BASE)},
            FULL: {
                "rope_type": "proportional",
                "partial_rotary_factor": PARTIAL_ROTARY,
                "rope_theta": k.positive("rope.freq_base", 1_000_000.0),
            },
        },
        attention_bias=False,
        sliding_window=k.count("attention.sliding_window"),
        layer_types=[SLIDING if s else FULL for s in sliding],
        final_logit_softcapping=k.optional_positive("final_logit_softcapping"),
        hidden_size_per_layer_input=0,
        num_kv_shared_layers=0,
        enable_moe_block=moe,
        num_experts=k.count("expert_count") if moe else None,
        top_k_experts=k.count("expert_used_count") if moe else None,
        moe_intermediate_size=k.count("expert_feed_forward_length") if moe else None,
    )
    if len({kv_heads[i] for i in full}) > 1 or len({kv_heads[i] for i in swa}) > 1:
        raise ModelLoadError(f"gemma4.attention.head_count_kv varies within a layer kind: {kv_heads}")


FAMILY = Family(
    name="gemma4",
    model_types=("gemma4", "gemma4_text"),
    hf=HFFacts(default_context=131_072, default_window=512, nested="gemma4"),
    gguf=GGUFFacts(
        arch="gemma4",
        model_type="gemma4_text",
        hf_class="Gemma4ForCausalLM",
        translate=translate,
        tensors=TENSORS,
        experts_join=ROWS,
        window=True,
        uniform_heads=False,
    ),
    tensor_parallel=None,  # no shard plan: its experts, and heads whose shape differs per layer
    tool_parser="gemma4",
)
