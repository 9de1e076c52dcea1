"""Qwen2 / Qwen2.5 (dense): Llama's blocks with a bias on the query, key and value projections only.

Owns `config_from_hf`, the reader of a Qwen2 `config.json` dict (model_type "qwen2"; Qwen2Config's
class defaults): q/k/v biased and o_proj not (`ModelConfig.o_proj_bias`), optional sliding
layers from `use_sliding_window` / `max_window_layers` as Qwen3 reads them. The module tree,
weight names and forward are Llama's (`llama.LlamaForCausalLM`; registry.py builds it). It does
not read files.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from freetoken.models.config import ModelConfig, hf_get, read_common, read_single_rope, read_switched_window

QWEN2_DEFAULTS = dict(
    vocab_size=151_936,
    hidden_size=4096,
    intermediate_size=22_016,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=32,
    rms_norm_eps=1e-6,
    max_position_embeddings=32_768,
    tie_word_embeddings=False,
    attention_bias=True,
    bos_token_id=None,
    eos_token_id=None,
)


def config_from_hf(config: Mapping[str, Any]) -> ModelConfig:
    """A Qwen2 `config.json` dict (model_type "qwen2") as a ModelConfig."""
    common = read_common(config, QWEN2_DEFAULTS)
    common["attention_bias"] = True  # Qwen2Attention: q/k/v with bias, o_proj without, whatever the dict says
    layer_types, window = read_switched_window(config, common["num_layers"])
    rope = read_single_rope(config, 10_000.0)
    return ModelConfig(
        architecture="qwen2",
        **common,
        o_proj_bias=False,
        layer_types=layer_types,
        rope_full=rope,
        rope_sliding=rope,
        sliding_window=window,
        hidden_act=str(hf_get(config, "hidden_act", "silu")),
    )
