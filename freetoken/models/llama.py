"""The Llama family (Llama 2/3, SmolLM2, ...): pre-norm blocks of GQA attention and a SwiGLU MLP.

Owns the module tree (parameter names follow transformers' LlamaForCausalLM without the
`model.` prefix), its forward over a paged KV cache, and `config_from_hf`, the reader of a Llama
`config.json` dict (LlamaConfig's class defaults, one rope for every layer). It does not read
files or pick pages.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from typing import Any

import torch
from torch import nn

from freetoken.attention.metadata import ForwardBatch
from freetoken.kv.tensors import KVTensors
from freetoken.models.config import FULL_ATTENTION, ModelConfig, hf_get, read_common, read_single_rope
from freetoken.models.linear import Weight
from freetoken.models.layers import (
    GatedMLP,
    RMSNorm,
    Rotary,
    SelfAttention,
    embedding,
    linear,
    load_named,
    output_logits,
    residual,
    strip_prefix,
)


class LlamaBlock(nn.Module):
    """Pre-norm: x + attn(norm(x)), then + mlp(norm(x)); the attention and MLP are given."""

    def __init__(
        self, config: ModelConfig, self_attn: nn.Module, mlp: nn.Module, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        super().__init__()
        c = config
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype, device)
        self.self_attn = self_attn
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype, device)
        self.mlp = mlp

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layer: int, batch: ForwardBatch, kv: KVTensors
    ) -> torch.Tensor:
        h = self.self_attn(self.input_layernorm(x), cos, sin, layer, batch, kv)
        x, y = residual(x, h, None, self.post_attention_layernorm)
        return x + self.mlp(y)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        c = config
        self.config = config
        self.embed_tokens = embedding(c.vocab_size, c.hidden_size, dtype, device)
        self.layers = nn.ModuleList(self.block_of(i, dtype, device) for i in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype, device)
        self.lm_head = None if c.tie_word_embeddings else linear(c.hidden_size, c.vocab_size, False, dtype, device)
        self.rotary = Rotary(c.rope_full, c.head_dim, device)

    def block_of(self, layer: int, dtype: torch.dtype, device: torch.device | str) -> LlamaBlock:
        """Layer `layer`'s block: what a Llama-shaped family (Qwen3) changes."""
        c = self.config
        mlp = GatedMLP(c.hidden_size, c.intermediate_size, c.hidden_act, c.mlp_bias, dtype, device)
        return LlamaBlock(c, SelfAttention(c, dtype, device), mlp, dtype, device)

    def _rename(self, name: str) -> str | None:
        if name == "lm_head.weight" and self.lm_head is None:
            return None  # tied: the embedding is the head
        return strip_prefix(name, ("model.",))

    def load_weights(
        self, tensors: MutableMapping[str, Weight], weights: str = "auto", prefill_weights: str = "quantized"
    ) -> None:
        """Load HF-named tensors (`model.layers.0.self_attn.q_proj.weight`, ...). `weights` is the `--weights` policy."""
        load_named(self, tensors, self._rename, weights, prefill_weights)

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch, kv: KVTensors) -> torch.Tensor:
        """input_ids [T] -> logits [N, vocab] for the rows batch.logits_indices."""
        x = self.embed_tokens(input_ids)  # [T, hidden]
        cos, sin = self.rotary.cos_sin(batch.positions)  # [T, D / 2] each, float32
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, i, batch, kv)
        return output_logits(x, batch, self.norm, self.embed_tokens, self.lm_head)  # [N, vocab]


# --- reading config.json -------------------------------------------------------------------------


def config_from_hf(config: Mapping[str, Any]) -> ModelConfig:
    """A Llama `config.json` dict (model_type "llama") as a ModelConfig."""
    defaults = dict(
        vocab_size=32_000,
        hidden_size=4096,
        intermediate_size=11_008,
        num_hidden_layers=32,
        num_attention_heads=32,
        rms_norm_eps=1e-6,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        attention_bias=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    rope = read_single_rope(config, 10_000.0)
    common = read_common(config, defaults)
    return ModelConfig(
        architecture="llama",
        **common,
        layer_types=(FULL_ATTENTION,) * common["num_layers"],
        rope_full=rope,
        rope_sliding=rope,
        hidden_act=str(hf_get(config, "hidden_act", "silu")),
        mlp_bias=bool(hf_get(config, "mlp_bias", False)),
    )
