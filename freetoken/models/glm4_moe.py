"""GLM-4.5 / 4.6 / 4.7 MoE (`glm4_moe`): Llama-shaped pre-norm blocks with partial rope, then a
sigmoid-routed mixture of SwiGLU experts beside a shared expert.

Owns the module tree (parameter names follow transformers' Glm4MoeForCausalLM without the
`model.` prefix) and its pieces:

- attention: q/k/v with biases (`attention_bias`; o_proj has none), optional per-head RMSNorms on
  q and k (`use_qk_norm`, Llama's form), and rope (NeoX halves) over only the first
  `partial_rotary_factor` of each head's channels;
- the first `first_k_dense_replace` layers keep a dense SwiGLU MLP; the others route each token
  by sigmoid(router logits) (router held in float32 under a half dtype, as Qwen3-MoE's): experts
  are chosen by score + `e_score_correction_bias` among the best `topk_group` of `n_group` groups
  (a group's score is the sum of its two best), weighted by their unbiased scores, renormalised
  (`norm_topk_prob`) and multiplied by `routed_scaling_factor`; all in batched tensor ops. The
  experts run through `models.experts.Experts` (grouped / packed kernels); a shared SwiGLU MLP of
  `n_shared_experts` experts' width is added unweighted.

The multi-token-prediction layers a checkpoint may hold after the decoder layers
(`num_nextn_predict_layers`, `model.layers.{N}.*` and on) are ignored. Also `config_from_hf`, the
reader of a `glm4_moe` config.json dict (Glm4MoeConfig's class defaults). It does not read files.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, MutableMapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from freetoken.attention.metadata import ForwardBatch
from freetoken.errors import ModelLoadError
from freetoken.kv.tensors import KVTensors
from freetoken.models.config import FULL_ATTENTION, ModelConfig, RopeConfig, hf_get, read_common, read_single_rope
from freetoken.models.experts import Experts, router_dtype, silu_gate, take_experts
from freetoken.models.layers import (
    GatedMLP,
    RMSNorm,
    Rotary,
    SelfAttention,
    load_named,
    paged_self_attention,
    rotate_partial_,
    split_qkv,
    take_all,
)
from freetoken.models.linear import Weight
from freetoken.models.llama import LlamaBlock, LlamaForCausalLM


class PartialRopeAttention(SelfAttention):
    """Fused-QKV attention whose query and key heads are (optionally) RMS-normed, then rotated over
    their first R channels only (cos, sin [T, R / 2])."""

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layer: int, batch: ForwardBatch, kv: KVTensors
    ) -> torch.Tensor:
        c = self.config
        T = x.shape[0]
        q, k, v = split_qkv(self.qkv_proj(x), c)  # [T, H, D], [T, n_kv, D] x 2 (views)
        q = self.q_norm(q) if self.q_norm is not None else q.contiguous()
        k = self.k_norm(k) if self.k_norm is not None else k.contiguous()
        q, k = rotate_partial_(q, cos, sin), rotate_partial_(k, cos, sin)
        out = paged_self_attention(q, k, v, layer, c, batch, kv)  # [T, H, D]
        return self.o_proj(out.reshape(T, c.num_heads * c.head_dim))  # [T, hidden]


class GroupRouter(nn.Module):
    """The router: `weight` [E, hidden] and `e_score_correction_bias` [E], held in `dtype`."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        c = config
        self.config = config
        self.weight = nn.Parameter(torch.empty(c.num_experts, c.hidden_size, dtype=dtype, device=device))
        self.e_score_correction_bias = nn.Parameter(torch.empty(c.num_experts, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (expert ids [T, k], their weights [T, k] in the router's dtype)."""
        c, w = self.config, self.weight
        scores = torch.sigmoid(F.linear(x.to(w.dtype), w))  # [T, E]
        choice = scores + self.e_score_correction_bias  # [T, E]: the bias moves the choice, not the weights
        if c.n_group > 1:
            T, E = choice.shape
            grouped = choice.view(T, c.n_group, E // c.n_group)  # [T, G, E / G]
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [T, G]
            kept = group_scores.topk(c.topk_group, dim=-1).indices  # [T, g]
            mask = torch.zeros(T, c.n_group, dtype=torch.bool, device=x.device).scatter_(1, kept, True)  # [T, G]
            choice = grouped.masked_fill(~mask[:, :, None], float("-inf")).view(T, E)
        ids = choice.topk(c.num_experts_per_tok, dim=-1).indices  # [T, k]
        top = scores.gather(1, ids)  # [T, k]
        if c.norm_topk_prob:
            top = top / (top.sum(dim=-1, keepdim=True) + 1e-20)
        return ids, top * c.routed_scaling_factor


class Glm4MoE(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        c = config
        # float32 under a half compute dtype (as Qwen3-MoE's router; transformers keeps it in float32 too)
        self.gate = GroupRouter(c, router_dtype(dtype), device)
        self.experts = Experts(c.num_experts, c.hidden_size, c.moe_intermediate_size, silu_gate, False, dtype, device)
        self.shared_experts = GatedMLP(
            c.hidden_size, c.shared_expert_intermediate_size, c.hidden_act, False, dtype, device
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]: each token through its top-k experts, weighted, plus the shared expert."""
        ids, weights = self.gate(x)  # [T, k] each
        return self.experts(x, ids, weights.to(x.dtype)) + self.shared_experts(x)


_MTP_LAYER = re.compile(r"(?:model\.)?layers\.(\d+)\.")


class Glm4MoeForCausalLM(LlamaForCausalLM):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__(config, dtype, device)
        c = config
        factor = c.rope_full.partial_rotary_factor or 1.0
        self.rotary = Rotary(c.rope_full, int(c.head_dim * factor), device)  # tables over the rotated channels

    def block_of(self, layer: int, dtype: torch.dtype, device: torch.device | str) -> LlamaBlock:
        c = self.config

        def head_norm() -> RMSNorm | None:
            return RMSNorm(c.head_dim, c.rms_norm_eps, dtype, device) if c.qk_norm else None

        attn = PartialRopeAttention(c, dtype, device, head_norm(), head_norm())
        if layer in c.dense_mlp_layers:
            mlp: nn.Module = GatedMLP(c.hidden_size, c.intermediate_size, c.hidden_act, False, dtype, device)
        else:
            mlp = Glm4MoE(c, dtype, device)
        return LlamaBlock(c, attn, mlp, dtype, device)

    def _rename(self, name: str) -> str | None:
        m = _MTP_LAYER.match(name)
        if m is not None and int(m[1]) >= self.config.num_layers:
            return None  # a multi-token-prediction layer
        return super()._rename(name)

    def load_weights(
        self, tensors: MutableMapping[str, Weight], weights: str = "auto", prefill_weights: str = "quantized"
    ) -> None:
        """Load HF-named tensors (`model.layers.1.mlp.gate.weight`, `...mlp.experts.gate_up_proj`, ...);
        `weights` is the `--weights` policy for projections, embeddings and experts (the router stays float)."""
        c = self.config
        rest: dict[str, Weight] = {}
        for name, t in take_all(tensors).items():
            local = self._rename(name)
            if local is not None:
                rest[local] = t
        for i, layer in enumerate(self.layers):
            if isinstance(layer.mlp, Glm4MoE):
                prefix = f"layers.{i}.mlp.experts."
                layer.mlp.experts.load(*take_experts(rest, prefix, c.num_experts, c.moe_intermediate_size, weights))
        load_named(self, rest, lambda name: name, weights, prefill_weights)


# --- reading config.json -------------------------------------------------------------------------


_DEFAULTS = dict(
    vocab_size=151_552,
    hidden_size=4096,
    intermediate_size=10_944,
    num_hidden_layers=46,
    num_attention_heads=96,
    num_key_value_heads=8,
    rms_norm_eps=1e-5,
    max_position_embeddings=131_072,
    tie_word_embeddings=False,
    attention_bias=False,
    bos_token_id=None,
    eos_token_id=None,
)


def _rope(config: Mapping[str, Any]) -> RopeConfig:
    """The one rope, over the first `partial_rotary_factor` (0.5 by default) of each head."""
    rope = read_single_rope(config, 10_000.0)
    if rope.partial_rotary_factor is None:
        factor = float(hf_get(config, "partial_rotary_factor", 0.5))
        rope = RopeConfig(**{**rope.__dict__, "partial_rotary_factor": factor})
    return rope


def config_from_hf(config: Mapping[str, Any]) -> ModelConfig:
    """A GLM-4.5 MoE `config.json` dict (model_type "glm4_moe") as a ModelConfig."""
    common = read_common(config, _DEFAULTS)
    n = common["num_layers"]
    experts = int(hf_get(config, "n_routed_experts", 128))
    dense = int(hf_get(config, "first_k_dense_replace", 1))
    groups = int(hf_get(config, "n_group", 1))
    if experts % groups:
        raise ModelLoadError(f"n_group {groups} does not divide the model's {experts} experts")
    moe_width = int(hf_get(config, "moe_intermediate_size", 1408))
    return ModelConfig(
        architecture="glm4_moe",
        **common,
        o_proj_bias=False,
        layer_types=(FULL_ATTENTION,) * n,
        rope_full=_rope(config),
        rope_sliding=_rope(config),
        hidden_act=str(hf_get(config, "hidden_act", "silu")),
        num_experts=experts,
        num_experts_per_tok=int(hf_get(config, "num_experts_per_tok", 8)),
        moe_intermediate_size=moe_width,
        shared_expert_intermediate_size=moe_width * int(hf_get(config, "n_shared_experts", 1)),
        norm_topk_prob=bool(hf_get(config, "norm_topk_prob", True)),
        dense_mlp_layers=tuple(range(min(dense, n))),
        n_group=groups,
        topk_group=int(hf_get(config, "topk_group", 1)),
        routed_scaling_factor=float(hf_get(config, "routed_scaling_factor", 1.0)),
        qk_norm=bool(hf_get(config, "use_qk_norm", False)),
    )
