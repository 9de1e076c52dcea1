"""gpt-oss: alternating sliding-window and full layers with attention sinks and a top-k MoE.

Owns the gpt-oss module tree (parameter names follow transformers' GptOssForCausalLM without the
`model.` prefix) and its forward: biased GQA attention with a learned sink logit per head, YaRN
rope, and a mixture of experts routed by softmax over the top-k router logits, each expert a
clamped SwiGLU `(up + 1) * gate * sigmoid(alpha * gate)`. It does not read files.
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
    RMSNorm, Rotary, apply_rope, compute_dtype, embedding, linear, load_named, output_logits, paged_self_attention,
    qkv_linear, split_qkv, strip_prefix,
)


def _norm(config: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> RMSNorm:
    # transformers keeps gpt-oss norms in float32 whatever the model dtype.
    return RMSNorm(config.hidden_size, config.rms_norm_eps, compute_dtype(dtype), device, scale_in_float=True)


class GptOssAttention(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        c, bias = config, config.attention_bias
        self.config = config
        self.qkv_proj = qkv_linear(c, dtype, device)
        self.o_proj = linear(c.num_heads * c.head_dim, c.hidden_size, bias, dtype, device)
        self.sinks = nn.Parameter(torch.empty(c.num_heads, dtype=dtype, device=device))

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layer: int, batch: ForwardBatch, kv: KVTensors
    ) -> torch.Tensor:
        c = self.config
        T = x.shape[0]
        q, k, v = split_qkv(self.qkv_proj(x), c)  # [T, H, D], [T, n_kv, D], [T, n_kv, D]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = paged_self_attention(q, k, v, layer, c, batch, kv, sinks=self.sinks)  # [T, H, D]
        return self.o_proj(out.reshape(T, c.num_heads * c.head_dim))  # [T, hidden]


class GptOssExperts(nn.Module):
    """The experts' weights, stacked: gate/up columns interleaved (gate at even, up at odd)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        E, h, i = config.num_experts, config.hidden_size, config.intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(E, h, 2 * i, dtype=dtype, device=device))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(E, 2 * i, dtype=dtype, device=device))
        self.down_proj = nn.Parameter(torch.empty(E, i, h, dtype=dtype, device=device))
        self.down_proj_bias = nn.Parameter(torch.empty(E, h, dtype=dtype, device=device))


class GptOssMoE(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.config = config
        self.router = linear(config.hidden_size, config.num_experts, True, dtype, device, quantizable=False)
        self.experts = GptOssExperts(config, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]: each token through its top-k experts, weighted."""
        c, ex = self.config, self.experts
        top_logits, top_idx = torch.topk(self.router(x), c.num_experts_per_tok, dim=-1)  # [T, k] each
        weights = torch.softmax(top_logits, dim=-1)  # [T, k]
        out = torch.zeros_like(x)  # [T, hidden]
        for e in top_idx.unique().tolist():
            tok, rank = torch.where(top_idx == e)  # tokens routed to e, and e's rank among their k
            gate_up = x[tok] @ ex.gate_up_proj[e] + ex.gate_up_proj_bias[e]  # [n, 2 * inter]
            gate = gate_up[:, 0::2].clamp(max=c.swiglu_limit)  # [n, inter]
            up = gate_up[:, 1::2].clamp(min=-c.swiglu_limit, max=c.swiglu_limit)  # [n, inter]
            h = (up + 1) * (gate * torch.sigmoid(gate * c.swiglu_alpha))  # [n, inter]
            y = h @ ex.down_proj[e] + ex.down_proj_bias[e]  # [n, hidden]
            out.index_add_(0, tok, (y * weights[tok, rank, None]).to(out.dtype))
        return out


class GptOssBlock(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.input_layernorm = _norm(config, dtype, device)
        self.self_attn = GptOssAttention(config, dtype, device)
        self.post_attention_layernorm = _norm(config, dtype, device)
        self.mlp = GptOssMoE(config, dtype, device)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layer: int, batch: ForwardBatch, kv: KVTensors
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, layer, batch, kv)
        return x + self.mlp(self.post_attention_layernorm(x))


class GptOssForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        c = config
        self.config = config
        self.embed_tokens = embedding(c.vocab_size, c.hidden_size, dtype, device)
        self.layers = nn.ModuleList(GptOssBlock(c, dtype, device) for _ in range(c.num_layers))
        self.norm = _norm(c, dtype, device)
        self.lm_head = None if c.tie_word_embeddings else linear(c.hidden_size, c.vocab_size, False, dtype, device)
        self.rotary = Rotary(c.rope_full, c.head_dim, device)

    def _rename(self, name: str) -> str | None:
        if name == "lm_head.weight" and self.lm_head is None:
            return None
        return strip_prefix(name, ("model.",))

    def load_weights(self, tensors: Mapping[str, Weight], weights: str = "auto", prefill_dense: bool = False) -> None:
        """Load HF-named tensors (`model.layers.0.mlp.experts.gate_up_proj`, ...); `weights` is the
        `--weights` policy for the attention projections and embeddings (experts and router stay float)."""
        load_named(self, tensors, self._rename, weights, prefill_dense)

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch, kv: KVTensors) -> torch.Tensor:
        """input_ids [T] -> logits [N, vocab] for the rows batch.logits_indices."""
        x = self.embed_tokens(input_ids)  # [T, hidden]
        cos, sin = self.rotary.cos_sin(batch.positions)  # [T, D / 2] each, float32
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, i, batch, kv)
        return output_logits(x, batch, self.norm, self.embed_tokens, self.lm_head)  # [N, vocab]
