"""Mistral (dense): Llama's blocks, every layer sliding when the checkpoint sets a window.

Owns `config_from_hf`, the reader of a Mistral `config.json` dict (model_type "mistral";
MistralConfig's class defaults): `sliding_window` (Mistral 7B v0.1: 4096; later versions null)
makes every layer a sliding-window layer, which the paged cache's SWA pool then holds. The module
tree, weight names and forward are Llama's (`llama.LlamaForCausalLM`; registry.py builds it).
(llama.cpp writes Mistral GGUFs as `llama`; those load through the Llama reader.) It does not read
files.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from freetoken.models.config import (
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    ModelConfig,
    hf_get,
    read_common,
    read_single_rope,
)

MISTRAL_DEFAULTS = dict(
    vocab_size=32_000,
    hidden_size=4096,
    intermediate_size=14_336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    rms_norm_eps=1e-6,
    max_position_embeddings=4096 * 32,
    tie_word_embeddings=False,
    attention_bias=False,
    bos_token_id=1,
    eos_token_id=2,
)


def config_from_hf(config: Mapping[str, Any]) -> ModelConfig:
    """A Mistral `config.json` dict (model_type "mistral") as a ModelConfig."""
    common = read_common(config, MISTRAL_DEFAULTS)
    window = hf_get(config, "sliding_window", None)
    kind = SLIDING_ATTENTION if window is not None else FULL_ATTENTION
    rope = read_single_rope(config, 10_000.0)
    return ModelConfig(
        architecture="mistral",
        **common,
        layer_types=(kind,) * common["num_layers"],
        rope_full=rope,
        rope_sliding=rope,
        sliding_window=int(window) if window is not None else None,
        hidden_act=str(hf_get(config, "hidden_act", "silu")),
    )
