"""Reading the Qwen3, Qwen3-MoE and Gemma 4 `config.json` into a `ModelConfig`.

Owns what these families' transformers config classes (`Qwen3Config`, `Qwen3MoeConfig`,
`Gemma4TextConfig`, and `Gemma4Config`'s `text_config`) default and derive: their class defaults,
Qwen3's sliding layers from `max_window_layers`, Qwen3-MoE's dense layers (`mlp_only_layers`,
`decoder_sparse_step`), Gemma 4's wider full-attention heads (`global_head_dim` and
`num_global_key_value_heads`, or the saved `per_layer_config`), and the Gemma 4 features FreeToken
refuses (per-layer embeddings, shared KV layers, bidirectional attention). `config.py` holds the
dataclasses and the older families; this module holds no weights.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from freetoken.errors import ModelLoadError
from freetoken.models.config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig, _common, _get, _rope, _single_rope

_QWEN3_DEFAULTS = dict(
    vocab_size=151_936, hidden_size=4096, intermediate_size=22_016, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=32, head_dim=128, rms_norm_eps=1e-6, max_position_embeddings=32_768,
    tie_word_embeddings=False, attention_bias=False, bos_token_id=None, eos_token_id=None,
)
_QWEN3_MOE_DEFAULTS = dict(
    _QWEN3_DEFAULTS, hidden_size=2048, intermediate_size=6144, num_hidden_layers=24, num_key_value_heads=4,
)
_GEMMA4_DEFAULTS = dict(
    vocab_size=262_144, hidden_size=2304, intermediate_size=9216, num_hidden_layers=30, num_attention_heads=8,
    num_key_value_heads=4, head_dim=256, rms_norm_eps=1e-6, max_position_embeddings=131_072,
    tie_word_embeddings=True, attention_bias=False, bos_token_id=2, eos_token_id=1, pad_token_id=0,
)
GEMMA4_GLOBAL_HEAD_DIM = 512  # Gemma4TextConfig's default global_head_dim
GEMMA4_PARTIAL_ROTARY = 0.25  # the full layers' default proportional rope share


def _qwen3(config: Mapping[str, Any]) -> ModelConfig:
    common = _common(config, _QWEN3_DEFAULTS)
    n = common["num_layers"]
    window = int(_get(config, "sliding_window", 4096)) if config.get("use_sliding_window") else None
    layer_types = config.get("layer_types") or [
        SLIDING_ATTENTION if window is not None and i >= int(_get(config, "max_window_layers", 28)) else FULL_ATTENTION
        for i in range(n)
    ]
    rope = _single_rope(config, 10_000.0)
    return ModelConfig(
        architecture="qwen3", **common, layer_types=tuple(layer_types), rope_full=rope, rope_sliding=rope,
        sliding_window=window if SLIDING_ATTENTION in layer_types else None,
        hidden_act=str(_get(config, "hidden_act", "silu")),
    )


def _qwen3_moe(config: Mapping[str, Any]) -> ModelConfig:
    common = _common(config, _QWEN3_MOE_DEFAULTS)
    n = common["num_layers"]
    window = int(_get(config, "sliding_window", 4096)) if config.get("use_sliding_window") else None
    experts = int(_get(config, "num_experts", _get(config, "num_local_experts", 128)))
    step = int(_get(config, "decoder_sparse_step", 1))
    mlp_only = set(_get(config, "mlp_only_layers", []))
    dense = tuple(i for i in range(n) if i in mlp_only or experts == 0 or (i + 1) % step != 0)
    rope = _single_rope(config, 10_000.0)
    return ModelConfig(
        architecture="qwen3_moe", **common,
        layer_types=(SLIDING_ATTENTION if window is not None else FULL_ATTENTION,) * n,  # HF slides every layer or none
        rope_full=rope, rope_sliding=rope, sliding_window=window,
        hidden_act=str(_get(config, "hidden_act", "silu")),
        num_experts=experts,
        num_experts_per_tok=int(_get(config, "num_experts_per_tok", 8)),
        moe_intermediate_size=int(_get(config, "moe_intermediate_size", 768)),
        norm_topk_prob=bool(_get(config, "norm_topk_prob", False)),
        dense_mlp_layers=dense,
    )


def _gemma4_full_heads(config: Mapping[str, Any], layer_types: list[str], kv_heads: int) -> tuple[int, int]:
    """(head_dim, kv heads) of the full-attention layers: the saved `per_layer_config` (uniform over
    the full layers, none on sliding ones), or `global_head_dim` / `num_global_key_value_heads` as
    Gemma4TextConfig derives it (the kv override only with attention_k_eq_v)."""
    saved = config.get("per_layer_config")
    if isinstance(saved, Mapping):
        shapes = {int(i): (v.get("head_dim"), v.get("num_key_value_heads")) for i, v in saved.items()}
        full = {shapes.get(i) for i, t in enumerate(layer_types) if t == FULL_ATTENTION}
        if len(full) > 1 or any(layer_types[i] != FULL_ATTENTION for i in shapes):
            raise ModelLoadError(f"gemma4 per_layer_config must give every full-attention layer one shape, got {dict(saved)}")
        head_dim, heads = full.pop() if full else (None, None)
        return int(head_dim or _get(config, "head_dim", 256)), int(heads or kv_heads)
    heads = config.get("num_global_key_value_heads") if _get(config, "attention_k_eq_v", False) else None
    return int(_get(config, "global_head_dim", GEMMA4_GLOBAL_HEAD_DIM)), int(heads or kv_heads)


def _gemma4(config: Mapping[str, Any]) -> ModelConfig:
    if int(_get(config, "hidden_size_per_layer_input", 256)):
        raise ModelLoadError("gemma4 with per-layer embeddings (hidden_size_per_layer_input > 0, Gemma 4 E2B/E4B) is not supported")
    if int(_get(config, "num_kv_shared_layers", 0)):
        raise ModelLoadError("gemma4 with shared KV layers (num_kv_shared_layers > 0) is not supported")
    if config.get("use_bidirectional_attention") == "all":
        raise ModelLoadError("gemma4 with use_bidirectional_attention='all' is not supported")
    common = _common(config, _GEMMA4_DEFAULTS)
    n = common["num_layers"]
    layer_types = list(config.get("layer_types") or [SLIDING_ATTENTION if (i + 1) % 6 else FULL_ATTENTION for i in range(n)])
    layer_types[-1] = FULL_ATTENTION  # as Gemma4TextConfig forces
    global_dim, global_heads = _gemma4_full_heads(config, layer_types, common["num_kv_heads"])
    params = config.get("rope_parameters") or {}
    full = dict(params.get(FULL_ATTENTION) or {"rope_type": "proportional", "partial_rotary_factor": GEMMA4_PARTIAL_ROTARY})
    moe = bool(_get(config, "enable_moe_block", False))
    return ModelConfig(
        architecture="gemma4", **common, layer_types=tuple(layer_types),
        rope_full=_rope(full, 1_000_000.0), rope_sliding=_rope(params.get(SLIDING_ATTENTION) or {}, 10_000.0),
        sliding_window=int(_get(config, "sliding_window", 512)),
        hidden_act=str(_get(config, "hidden_activation", "gelu_pytorch_tanh")),
        query_pre_attn_scalar=1.0,  # Gemma 4 attends with scale 1 (its q/k norms set the logits' size)
        final_logit_softcapping=config.get("final_logit_softcapping"),
        num_experts=int(_get(config, "num_experts", 0)) if moe else 0,
        num_experts_per_tok=int(_get(config, "top_k_experts", 0)) if moe else 0,
        moe_intermediate_size=int(_get(config, "moe_intermediate_size", 0)) if moe else 0,
        global_head_dim=global_dim, num_global_kv_heads=global_heads,
        attention_k_eq_v=bool(_get(config, "attention_k_eq_v", False)),
    )


def _gemma4_multimodal(config: Mapping[str, Any]) -> ModelConfig:
    text = config.get("text_config")
    if not isinstance(text, Mapping):
        raise ModelLoadError("gemma4 config.json has no text_config")
    return _gemma4({**text, "model_type": "gemma4_text"})


READERS: dict[str, Callable[[Mapping[str, Any]], ModelConfig]] = {
    "qwen3": _qwen3, "qwen3_moe": _qwen3_moe, "gemma4_text": _gemma4, "gemma4": _gemma4_multimodal,
}
