"""Qwen3-MoE: Qwen3's attention blocks with a top-k mixture of SwiGLU experts.

Owns the router of Qwen3's sparse layers (softmax over all experts in float32, top-k, optionally
renormalised to sum to 1: `norm_topk_prob`); the experts' tensors are taken and run by
`models.experts` (`take_experts`, `Experts`). Layers listed in
`dense_mlp_layers` (`mlp_only_layers`, `decoder_sparse_step`) keep Qwen3's dense MLP. Attention,
norms and the model skeleton are `qwen3.py`'s. Also `config_from_hf`, the reader of a Qwen3-MoE
`config.json` dict (Qwen3MoeConfig's class defaults, the dense layers). It does not read files.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from typing import Any

import torch
from torch import nn

from freetoken.models.config import (
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    ModelConfig,
    hf_get,
    read_common,
    read_single_rope,
)
from freetoken.models.experts import Experts, router_dtype, silu_gate, take_experts
from freetoken.models.layers import linear, load_named, strip_prefix, take_all
from freetoken.models.linear import Weight
from freetoken.models.qwen3 import QWEN3_DEFAULTS, Qwen3ForCausalLM


class Qwen3MoE(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        c = config
        self.config = config
        # The router is held and multiplied in float32 under a half compute dtype: a bfloat16 1-row
        # GEMM of this shape took ~3x as long (Qwen3-MoE shape: ~7% of a decode step), and a GGUF
        # stores it in float32 (its family's `float32` names: the loader hands it over unrounded).
        self.gate = linear(c.hidden_size, c.num_experts, False, router_dtype(dtype), device, quantizable=False)
        self.experts = Experts(c.num_experts, c.hidden_size, c.moe_intermediate_size, silu_gate, False, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]: each token through its top-k experts, weighted."""
        logits = self.gate(x.to(self.gate.dtype))  # [T, E]
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)  # [T, E]
        top, idx = torch.topk(probs, self.config.num_experts_per_tok, dim=-1)  # [T, k] each
        if self.config.norm_topk_prob:
            top = top / top.sum(dim=-1, keepdim=True)
        return self.experts(x, idx, top.to(x.dtype))


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    def mlp_of(self, layer: int, dtype: torch.dtype, device: torch.device | str) -> nn.Module:
        if layer in self.config.dense_mlp_layers:
            return super().mlp_of(layer, dtype, device)
        return Qwen3MoE(self.config, dtype, device)

    def load_weights(
        self, tensors: MutableMapping[str, Weight], weights: str = "auto", prefill_weights: str = "quantized"
    ) -> None:
        """Load HF-named tensors (`model.layers.0.mlp.gate.weight`, `...mlp.experts.gate_up_proj`, ...);
        `weights` is the `--weights` policy for projections, embeddings and experts (the router stays float)."""
        c = self.config
        rest = {strip_prefix(name, ("model.",)): t for name, t in take_all(tensors).items()}
        for i, layer in enumerate(self.layers):
            if isinstance(layer.mlp, Qwen3MoE):
                prefix = f"layers.{i}.mlp.experts."
                layer.mlp.experts.load(*take_experts(rest, prefix, c.num_experts, c.moe_intermediate_size, weights))
        load_named(self, rest, self._rename, weights, prefill_weights)


# --- reading config.json -------------------------------------------------------------------------


_DEFAULTS = dict(QWEN3_DEFAULTS, hidden_size=2048, intermediate_size=6144, num_hidden_layers=24, num_key_value_heads=4)


def config_from_hf(config: Mapping[str, Any]) -> ModelConfig:
    """A Qwen3-MoE `config.json` dict (model_type "qwen3_moe") as a ModelConfig."""
    common = read_common(config, _DEFAULTS)
    n = common["num_layers"]
    window = int(hf_get(config, "sliding_window", 4096)) if config.get("use_sliding_window") else None
    experts = int(hf_get(config, "num_experts", hf_get(config, "num_local_experts", 128)))
    step = int(hf_get(config, "decoder_sparse_step", 1))
    mlp_only = set(hf_get(config, "mlp_only_layers", []))
    dense = tuple(i for i in range(n) if i in mlp_only or experts == 0 or (i + 1) % step != 0)
    rope = read_single_rope(config, 10_000.0)
    return ModelConfig(
        architecture="qwen3_moe",
        **common,
        layer_types=(SLIDING_ATTENTION if window is not None else FULL_ATTENTION,) * n,  # HF slides every layer or none
        rope_full=rope,
        rope_sliding=rope,
        sliding_window=window,
        hidden_act=str(hf_get(config, "hidden_act", "silu")),
        num_experts=experts,
        num_experts_per_tok=int(hf_get(config, "num_experts_per_tok", 8)),
        moe_intermediate_size=int(hf_get(config, "moe_intermediate_size", 768)),
        norm_topk_prob=bool(hf_get(config, "norm_topk_prob", False)),
        dense_mlp_layers=dense,
    )
