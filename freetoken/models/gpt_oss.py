"""gpt-oss: alternating sliding-window and full layers with attention sinks and a top-k MoE.

Owns the gpt-oss module tree (parameter names follow transformers' GptOssForCausalLM without the
`model.` prefix) and its forward: biased GQA attention with a learned sink logit per head, YaRN
rope, and a mixture of experts (`models.experts`) routed by softmax over the top-k router logits,
each expert a clamped SwiGLU `(up + 1) * gate * sigmoid(alpha * gate)`; and the translation of
HF's expert tensors (float interleaved gate/up, or MXFP4 blocks kept packed) into the Experts'
per-projection stacks; and `config_from_hf`, the reader of a gpt-oss `config.json` dict
(GptOssConfig's class defaults, YaRN rope where none is given). It does not read files.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from typing import Any

import torch
from torch import nn

from freetoken.attention.metadata import ForwardBatch
from freetoken.errors import ModelLoadError
from freetoken.kv.tensors import KVTensors
from freetoken.models.config import (
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    ModelConfig,
    hf_get,
    read_common,
    read_single_rope,
)
from freetoken.models.experts import Activation, Experts, ExpertStack, with_policy
from freetoken.models.layers import (
    RMSNorm,
    Rotary,
    apply_rope,
    compute_dtype,
    embedding,
    linear,
    load_named,
    output_logits,
    paged_self_attention,
    qkv_linear,
    split_qkv,
    strip_prefix,
    take_all,
)
from freetoken.models.linear import Weight
from freetoken.ops.quantized import QuantizedWeight
from freetoken.weights.dequant import Deferred, mxfp4_matrix, mxfp4_q


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


def clamped_swiglu(config: ModelConfig) -> Activation:
    """gpt-oss's expert activation: `(up + 1) * gate * sigmoid(alpha * gate)`, both clamped."""
    limit, alpha = config.swiglu_limit, config.swiglu_alpha

    def act(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:  # [n, I] each -> [n, I]
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
        return (up + 1) * (gate * torch.sigmoid(gate * alpha))

    return act


def _mxfp4_stack(blocks: torch.Tensor, scales: torch.Tensor, name: str, rows: slice = slice(None)) -> list[Deferred]:
    """HF MXFP4 `blocks` [E, N, G, 16] and `scales` [E, N, G] -> E matrices [len(rows), 32 G]
    (their `rows`), each decoded (to the exact 8-bit form) only when the experts load or,
    offloaded, on a miss."""
    part_blocks, part_scales = blocks[:, rows], scales[:, rows]  # views: nothing read yet
    E, N, G = part_scales.shape

    def decode(e: int) -> torch.Tensor | QuantizedWeight:
        return mxfp4_matrix(mxfp4_q(part_blocks[e], interleaved=True), part_scales[e], f"{name} expert {e}")

    return [Deferred((N, 32 * G), N * G * 17, lambda e=e: decode(e)) for e in range(E)]


def split_experts(tensors: dict[str, Weight], layer: int, weights: str) -> tuple[ExpertStack, ...]:
    """Take layer `layer`'s expert tensors out of `tensors` (HF names, `model.` optional): HF's
    float `gate_up_proj` [E, H, 2I] (gate at even columns) and `down_proj` [E, I, H], or their
    MXFP4 `*_blocks` / `*_scales` [E, out, in / 32, (16)], or the GGUF loader's per-expert lists
    `gate_proj` / `up_proj` [I, H] and `down_proj` [H, I], plus the biases -> Experts.load's
    (gate [E, I, H], up, down [E, H, I], gate_bias [E, I], up_bias, down_bias), `weights` applied."""
    take: dict[str, Weight] = {}
    for prefix in (f"model.layers.{layer}.mlp.experts.", f"layers.{layer}.mlp.experts."):
        for key in [k for k in tensors if k.startswith(prefix)]:
            take[key[len(prefix) :]] = tensors.pop(key)
    name = f"layers.{layer}.mlp.experts"
    if "gate_up_proj_blocks" in take and "gate_up_proj_scales" in take:
        fused = take.pop("gate_up_proj_blocks"), take.pop("gate_up_proj_scales")  # [E, 2I, ...]: gate rows even
        gate = _mxfp4_stack(*fused, name, slice(0, None, 2))  # E x [I, H]
        up = _mxfp4_stack(*fused, name, slice(1, None, 2))
        blocks, scales = take.pop("down_proj_blocks", None), take.pop("down_proj_scales", None)
        down = None if blocks is None or scales is None else _mxfp4_stack(blocks, scales, name)  # E x [H, I]
    elif "gate_proj" in take and "up_proj" in take:  # GGUF stacks kept packed: E matrices [out, in] each
        gate, up, down = take.pop("gate_proj"), take.pop("up_proj"), take.pop("down_proj", None)
    elif "gate_up_proj" in take and "down_proj" in take:
        stacked = take.pop("gate_up_proj").transpose(1, 2)  # [E, 2I, H]
        gate, up = stacked[:, 0::2], stacked[:, 1::2]  # [E, I, H] each
        down = take.pop("down_proj").transpose(1, 2)  # [E, H, I]
    else:
        down = None
    if down is None:
        raise ModelLoadError(f"missing tensors: {name}.gate_up_proj / down_proj (or their MXFP4 _blocks / _scales)")
    bias, down_bias = take.pop("gate_up_proj_bias", None), take.pop("down_proj_bias", None)
    if bias is None or down_bias is None or take:
        raise ModelLoadError(f"{name}: missing biases or unexpected tensors {sorted(take)}")
    return (
        with_policy(gate, weights),
        with_policy(up, weights),
        with_policy(down, weights),
        bias[:, 0::2],
        bias[:, 1::2],
        down_bias,
    )


class GptOssMoE(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        c = config
        self.config = config
        self.router = linear(c.hidden_size, c.num_experts, True, dtype, device, quantizable=False)
        self.experts = Experts(
            c.num_experts, c.hidden_size, c.intermediate_size, clamped_swiglu(c), True, dtype, device
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]: each token through its top-k experts, weighted."""
        top_logits, top_idx = torch.topk(self.router(x), self.config.num_experts_per_tok, dim=-1)  # [T, k] each
        return self.experts(x, top_idx, torch.softmax(top_logits, dim=-1))


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

    def load_weights(
        self, tensors: MutableMapping[str, Weight], weights: str = "auto", prefill_weights: str = "quantized"
    ) -> None:
        """Load HF-named tensors (`model.layers.0.mlp.experts.gate_up_proj`, ...); `weights` is the
        `--weights` policy for the attention projections, embeddings and experts (the router stays
        float); experts come as HF's interleaved float stacks or MXFP4 `*_blocks` / `*_scales`."""
        rest = take_all(tensors)
        for i, layer in enumerate(self.layers):
            layer.mlp.experts.load(*split_experts(rest, i, weights))
        load_named(self, rest, self._rename, weights, prefill_weights)

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
    """A gpt-oss `config.json` dict (model_type "gpt_oss") as a ModelConfig."""
    defaults = dict(
        vocab_size=201_088,
        hidden_size=2880,
        intermediate_size=2880,
        num_hidden_layers=36,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=64,
        rms_norm_eps=1e-5,
        max_position_embeddings=131_072,
        tie_word_embeddings=False,
        attention_bias=True,
        bos_token_id=None,
        eos_token_id=None,
    )
    common = read_common(config, defaults)
    num_layers = common["num_layers"]
    layer_types = config.get("layer_types") or [
        SLIDING_ATTENTION if (i + 1) % 2 else FULL_ATTENTION for i in range(num_layers)
    ]
    if config.get("rope_parameters") is None and config.get("rope_scaling") is None:
        config = {
            **config,
            "rope_parameters": {
                "rope_type": "yarn",
                "factor": 32.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 4096,
            },
        }
    rope = read_single_rope(config, 150_000.0)
    return ModelConfig(
        architecture="gpt_oss",
        **common,
        layer_types=tuple(layer_types),
        rope_full=rope,
        rope_sliding=rope,
        sliding_window=int(hf_get(config, "sliding_window", 128)),
        hidden_act="swiglu_clamped",
        num_experts=int(hf_get(config, "num_local_experts", 128)),
        num_experts_per_tok=int(hf_get(config, "num_experts_per_tok", 4)),
        swiglu_alpha=float(hf_get(config, "swiglu_alpha", 1.702)),
        swiglu_limit=float(hf_get(config, "swiglu_limit", 7.0)),
    )
