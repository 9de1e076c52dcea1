"""Qwen3 (dense): what the layers below the models know of it (the model is `models/qwen3.py`).

GGUF (`qwen3`): every layer full; head_dim from `attention.key_length` (else hidden / heads); rope
base 1e6 unless the file says, linear / YaRN scaling when it does. Llama's names plus the q/k
norms; no row permutation (NeoX rope, as HF). A `config.json`'s `sliding_window` counts only with
`use_sliding_window` set.
"""

from __future__ import annotations

from collections.abc import Collection

from freetoken.families.base import ATTENTION, DENSE_MLP, FULL, Family, GGUFFacts, HFFacts, layers_of, scaled_rope
from freetoken.families.gguf_keys import Keys

TENSORS: dict[str, str] = {
    **ATTENTION,
    **DENSE_MLP,
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}


def translate(k: Keys, cfg: dict[str, object], tensor_names: Collection[str]) -> None:
    """Qwen3's keys (Qwen3-MoE's attention too: `qwen3_moe.translate` adds its experts)."""
    hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])  # type: ignore[call-overload]
    cfg.update(
        intermediate_size=k.integer("feed_forward_length", k.integer("expert_feed_forward_length", 0)),
        head_dim=k.count("attention.key_length", hidden // heads),
        hidden_act="silu",
        rope_parameters=scaled_rope(k, 1_000_000.0),
        attention_bias=False,
        layer_types=[FULL] * layers_of(cfg),
        sliding_window=None,
        use_sliding_window=False,
    )


FAMILY = Family(
    name="qwen3",
    model_types=("qwen3",),
    hf=HFFacts(default_context=32_768, default_window=None, switched_window=True),
    gguf=GGUFFacts(arch="qwen3", model_type="qwen3", hf_class="Qwen3ForCausalLM", translate=translate, tensors=TENSORS),
)
