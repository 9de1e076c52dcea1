"""Qwen3 (dense): Llama-shaped pre-norm blocks whose query and key heads are RMS-normed before rope.

Owns the Qwen3 module tree (parameter names follow transformers' Qwen3ForCausalLM without the
`model.` prefix) and its forward over a paged KV cache: GQA with an explicit head_dim, a per-head
RMSNorm on q and k (weight applied after the cast back, as Llama's norm), SwiGLU, optional sliding
layers (`use_sliding_window`). `Qwen3ForCausalLM.mlp_of` is the one place Qwen3-MoE
(`qwen3_moe.py`) changes; the rest (blocks, load, forward) is Llama's (`llama.py`). It does not
read files.
"""

from __future__ import annotations

import torch
from torch import nn

from freetoken.models.layers import GatedMLP, RMSNorm, SelfAttention
from freetoken.models.llama import LlamaBlock, LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    def block_of(self, layer: int, dtype: torch.dtype, device: torch.device | str) -> LlamaBlock:
        """Llama's block with q/k RMSNorms in the attention and `mlp_of(layer)` as its MLP."""
        c = self.config
        attn = SelfAttention(
            c, dtype, device, RMSNorm(c.head_dim, c.rms_norm_eps, dtype, device), RMSNorm(c.head_dim, c.rms_norm_eps, dtype, device),
        )
        return LlamaBlock(c, attn, self.mlp_of(layer, dtype, device), dtype, device)

    def mlp_of(self, layer: int, dtype: torch.dtype, device: torch.device | str) -> nn.Module:
        """The feed-forward of `layer`: [T, hidden] -> [T, hidden]."""
        c = self.config
        return GatedMLP(c.hidden_size, c.intermediate_size, c.hidden_act, False, dtype, device)
