"""Qwen3 (dense): Llama-shaped pre-norm blocks whose query and key heads are RMS-normed before rope.

Owns the Qwen3 module tree (parameter names follow transformers' Qwen3ForCausalLM without the
`model.` prefix) and its forward over a paged KV cache: GQA with an explicit head_dim, a per-head
RMSNorm on q and k (weight applied after the cast back, as Llama's norm), SwiGLU, optional sliding
layers (`use_sliding_window`). `Qwen3ForCausalLM.mlp_of` is the one place Qwen3-MoE
(`qwen3_moe.py`) changes. It does not read files.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from freetoken.attention.metadata import ForwardBatch
from freetoken.kv.tensors import KVTensors
from freetoken.models.config import ModelConfig
from freetoken.models.linear import Weight
from freetoken.models.layers import (
    GatedMLP, RMSNorm, Rotary, attention_inputs, embedding, linear, load_named, output_logits, paged_self_attention,
    qkv_linear, residual, strip_prefix,
)


class Qwen3Attention(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        c = config
        self.config = config
        self.qkv_proj = qkv_linear(c, dtype, device)
        self.o_proj = linear(c.num_heads * c.head_dim, c.hidden_size, c.attention_bias, dtype, device)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps, dtype, device)
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps, dtype, device)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layer: int, batch: ForwardBatch, kv: KVTensors
    ) -> torch.Tensor:
        c = self.config
        T = x.shape[0]
        qkv = self.qkv_proj(x)  # [T, (H + 2 n_kv) D]
        q, k, v = attention_inputs(qkv, c, cos, sin, self.q_norm, self.k_norm)  # [T, H, D], [T, n_kv, D] x 2
        out = paged_self_attention(q, k, v, layer, c, batch, kv)  # [T, H, D]
        return self.o_proj(out.reshape(T, c.num_heads * c.head_dim))  # [T, hidden]


class Qwen3Block(nn.Module):
    def __init__(self, config: ModelConfig, mlp: nn.Module, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        c = config
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype, device)
        self.self_attn = Qwen3Attention(c, dtype, device)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype, device)
        self.mlp = mlp

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layer: int, batch: ForwardBatch, kv: KVTensors
    ) -> torch.Tensor:
        h = self.self_attn(self.input_layernorm(x), cos, sin, layer, batch, kv)
        x, y = residual(x, h, None, self.post_attention_layernorm)
        return x + self.mlp(y)


class Qwen3ForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        c = config
        self.config = config
        self.embed_tokens = embedding(c.vocab_size, c.hidden_size, dtype, device)
        self.layers = nn.ModuleList(Qwen3Block(c, self.mlp_of(i, dtype, device), dtype, device) for i in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype, device)
        self.lm_head = None if c.tie_word_embeddings else linear(c.hidden_size, c.vocab_size, False, dtype, device)
        self.rotary = Rotary(c.rope_full, c.head_dim, device)

    def mlp_of(self, layer: int, dtype: torch.dtype, device: torch.device | str) -> nn.Module:
        """The feed-forward of `layer`: [T, hidden] -> [T, hidden]."""
        c = self.config
        return GatedMLP(c.hidden_size, c.intermediate_size, c.hidden_act, False, dtype, device)

    def _rename(self, name: str) -> str | None:
        if name == "lm_head.weight" and self.lm_head is None:
            return None  # tied: the embedding is the head
        return strip_prefix(name, ("model.",))

    def load_weights(self, tensors: Mapping[str, Weight], weights: str = "auto", prefill_dense: bool = False) -> None:
        """Load HF-named tensors (`model.layers.0.self_attn.q_norm.weight`, ...) under the `--weights` policy."""
        load_named(self, tensors, self._rename, weights, prefill_dense)

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch, kv: KVTensors) -> torch.Tensor:
        """input_ids [T] -> logits [N, vocab] for the rows batch.logits_indices."""
        x = self.embed_tokens(input_ids)  # [T, hidden]
        cos, sin = self.rotary.cos_sin(batch.positions)  # [T, D / 2] each, float32
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, i, batch, kv)
        return output_logits(x, batch, self.norm, self.embed_tokens, self.lm_head)  # [N, vocab]
