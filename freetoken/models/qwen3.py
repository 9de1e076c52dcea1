"""Qwen3 (dense): Llama-shaped pre-norm blocks whose query and key heads are RMS-normed before rope.

Owns the Qwen3 module tree (parameter names follow transformers' Qwen3ForCausalLM without the
`model.` prefix) and its forward over a paged KV cache: GQA with an explicit head_dim, a per-head
RMSNorm on q and k (weight applied after the cast back, as Llama's norm), SwiGLU, optional sliding
layers (`use_sliding_window`). `Qwen3ForCausalLM.mlp_of` is the one place Qwen3-MoE
(`qwen3_moe.py`) changes; the rest (blocks, load, forward) is Llama's (`llama.py`). Also
`config_from_hf`, the reader of a Qwen3 `config.json` dict: Qwen3Config's class defaults
(`QWEN3_DEFAULTS`, which Qwen3-MoE's start from) and the sliding layers from `max_window_layers`.
It does not read files.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from freetoken.models.config import ModelConfig, hf_get, read_common, read_single_rope, read_switched_window
from freetoken.models.layers import GatedMLP, RMSNorm, SelfAttention
from freetoken.models.llama import LlamaBlock, LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    def block_of(self, layer: int, dtype: torch.dtype, device: torch.device | str) -> LlamaBlock:
        """Llama's block with q/k RMSNorms in the attention and `mlp_of(layer)` as its MLP."""
        c = self.config
        attn = SelfAttention(
            c,
            dtype,
            device,
            RMSNorm(c.head_dim, c.rms_norm_eps, dtype, device),
            RMSNorm(c.head_dim, c.rms_norm_eps, dtype, device),
        )
        return LlamaBlock(c, attn, self.mlp_of(layer, dtype, device), dtype, device)

    def mlp_of(self, layer: int, dtype: torch.dtype, device: torch.device | str) -> nn.Module:
        """The feed-forward of `layer`: [T, hidden] -> [T, hidden]."""
        c = self.config
        return GatedMLP(c.hidden_size, c.intermediate_size, c.hidden_act, False, dtype, device)


# --- reading config.json -------------------------------------------------------------------------


QWEN3_DEFAULTS = dict(
    vocab_size=151_936,
    hidden_size=4096,
    intermediate_size=22_016,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=32,
    head_dim=128,
    rms_norm_eps=1e-6,
    max_position_embeddings=32_768,
    tie_word_embeddings=False,
    attention_bias=False,
    bos_token_id=None,
    eos_token_id=None,
)


def config_from_hf(config: Mapping[str, Any]) -> ModelConfig:
    """A Qwen3 `config.json` dict (model_type "qwen3") as a ModelConfig."""
    common = read_common(config, QWEN3_DEFAULTS)
    layer_types, window = read_switched_window(config, common["num_layers"])
    rope = read_single_rope(config, 10_000.0)
    return ModelConfig(
        architecture="qwen3",
        **common,
        layer_types=layer_types,
        rope_full=rope,
        rope_sliding=rope,
        sliding_window=window,
        hidden_act=str(hf_get(config, "hidden_act", "silu")),
    )
