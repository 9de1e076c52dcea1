"""Qwen3.5 / Qwen3.6 (dense and MoE): a hybrid of Gated DeltaNet (linear attention) and gated
full-attention layers.

Owns the module tree (parameter names follow transformers' Qwen3_5ForCausalLM /
Qwen3_5MoeForCausalLM without the `model.` prefix; a multimodal checkpoint's
`model.language_model.` prefix is read too, its vision tower and MTP head ignored) and its
forward. The family's pieces:

- every RMSNorm scales by (1 + w), computed in float32 before the cast back (Gemma's form),
  except the linear layers' gated output norm, which scales by w and multiplies by silu(z);
- gated attention: `q_proj` yields, per head, the query and then an output gate; the query and
  key heads are RMS-normed, rotated over their first `partial_rotary_factor` of channels only
  (ordinary rope: for text tokens the multimodal rope's three sections see one position), and
  the attention output is multiplied by sigmoid(gate) before `o_proj`;
- Gated DeltaNet: q, k, v from one projection through a short causal depthwise convolution
  (silu), q and k L2-normed (q also by Dk^-0.5), key heads repeated over the value heads, beta =
  sigmoid(b), log decay g = -exp(A_log) softplus(a + dt_bias); the delta rule
  (ops/gated_delta.py) in the chunked form over a request's prefill chunk and in the recurrent
  form over decode rows, reading and writing the request's state slot in place
  (`ForwardBatch.state_slots`; a request whose first new token is at position 0 starts from
  zero); conv and recurrent states are float32;
- the MoE (Qwen3.5-MoE): Qwen3-MoE's softmax router (top-k always renormalised) and experts
  (`qwen3_moe.py`), plus a shared expert whose output is scaled by sigmoid(shared_expert_gate).

Qwen3-Next (`qwen3_next`) is this network too: its fused `in_proj_qkvz` / `in_proj_ba` (or, from
llama.cpp's GGUF, the fused b/a alone) are split at load into the four projections above
(`_split_fused_projections`), and its config may name dense layers and leave the top k
unrenormalised.

Also `config_from_hf`, the reader of a `qwen3_5` / `qwen3_5_moe` / `qwen3_next` config.json dict
(the text model's, or a multimodal checkpoint's `text_config`). It does not read files or pick slots.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from freetoken.attention.metadata import ForwardBatch
from freetoken.errors import ModelLoadError
from freetoken.kv.tensors import KVTensors
from freetoken.models.config import (
    FULL_ATTENTION,
    LINEAR_ATTENTION,
    ModelConfig,
    RopeConfig,
    hf_get,
    read_common,
    read_single_rope,
)
from freetoken.models.experts import take_experts
from freetoken.models.layers import (
    GatedMLP,
    RMSNorm,
    Rotary,
    compute_dtype,
    embedding,
    linear,
    load_named,
    output_logits,
    paged_self_attention,
    residual,
    rotate_partial_,
    strip_prefix,
    take_all,
)
from freetoken.models.linear import Weight
from freetoken.models.qwen3_moe import Qwen3MoE
from freetoken.ops.gated_delta import causal_conv1d, causal_conv1d_step_, chunk_gated_delta_rule, recurrent_gated_delta_


def unit_norm(dim: int, eps: float, dtype: torch.dtype, device: torch.device | str) -> RMSNorm:
    """The family's RMSNorm: x / rms(x) * (1 + w), in float32 before the cast back."""
    return RMSNorm(dim, eps, dtype, device, unit_offset=True)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dimension."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


class GatedAttention(nn.Module):
    """Full attention over the paged cache with q/k norms, partial rope and a sigmoid output gate.
    `qkv_proj` is transformers' q_proj (per head: D query rows, then D gate rows), k_proj and
    v_proj stacked at load."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        c = config
        self.config = config
        rows = (2 * c.num_heads + 2 * c.num_kv_heads) * c.head_dim
        self.qkv_proj = linear(c.hidden_size, rows, c.attention_bias, dtype, device)
        self.o_proj = linear(c.num_heads * c.head_dim, c.hidden_size, c.attention_bias, dtype, device)
        self.q_norm = unit_norm(c.head_dim, c.rms_norm_eps, dtype, device)
        self.k_norm = unit_norm(c.head_dim, c.rms_norm_eps, dtype, device)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layer: int, batch: ForwardBatch, kv: KVTensors
    ) -> torch.Tensor:
        c = self.config
        T, H, n_kv, D = x.shape[0], c.num_heads, c.num_kv_heads, c.head_dim
        qkv = self.qkv_proj(x)  # [T, (2 H + 2 n_kv) D]
        qg, k, v = qkv.split((2 * H * D, n_kv * D, n_kv * D), dim=-1)
        qg = qg.view(T, H, 2 * D)  # per head: query, then gate
        gate = qg[..., D:].reshape(T, H * D)  # [T, H D]
        q = rotate_partial_(self.q_norm(qg[..., :D].contiguous()), cos, sin)  # [T, H, D]
        k = rotate_partial_(self.k_norm(k.reshape(T, n_kv, D)), cos, sin)  # [T, n_kv, D]
        out = paged_self_attention(q, k, v.reshape(T, n_kv, D), layer, c, batch, kv)  # [T, H, D]
        return self.o_proj(out.reshape(T, H * D) * torch.sigmoid(gate))  # [T, hidden]


class ConvWeight(nn.Module):
    """A depthwise convolution's kernel as transformers stores it: weight [channels, 1, K]."""

    def __init__(self, channels: int, kernel: int, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel, dtype=dtype, device=device))


class GatedRMSNorm(nn.Module):
    """rms_norm(x) * w (cast back to x's dtype first), then * silu(z) in float32, per value head."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype, device=device))
        self.eps = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """x, z [..., D] -> [..., D] in x's dtype."""
        xf = x.to(compute_dtype(x.dtype))
        normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight
        return (normed.to(xf.dtype) * F.silu(z.to(xf.dtype))).to(x.dtype)


class LinearPlan:
    """How a batch's requests run through the linear layers, the same for every layer: decode
    rows (one new token) together in the recurrent form, each longer chunk alone in the chunked
    form; and the slots to clear (requests starting at position 0)."""

    def __init__(self, batch: ForwardBatch) -> None:
        if batch.state_slots is None:
            raise ValueError("a model with linear-attention layers needs ForwardBatch.state_slots")
        starts = batch.query_start.tolist()
        slots = batch.state_slots.tolist()
        first = batch.positions[batch.query_start[:-1]].tolist()  # position of each request's first new token
        self.fresh = [s for s, p in zip(slots, first) if p == 0]
        self.chunks = [(starts[b], starts[b + 1], slots[b]) for b in range(len(slots)) if starts[b + 1] - starts[b] > 1]
        rows = [(starts[b], slots[b]) for b in range(len(slots)) if starts[b + 1] - starts[b] == 1]
        device = batch.query_start.device
        self.decode_rows = torch.tensor([r for r, _ in rows], dtype=torch.long, device=device)  # [Bd]
        self.decode_slots = torch.tensor([s for _, s in rows], dtype=torch.long, device=device)  # [Bd]

    @staticmethod
    def of(batch: ForwardBatch) -> LinearPlan:
        """The batch's plan, made by the first linear layer and reused by the others."""
        plan = batch.memo.get(LinearPlan)
        if plan is None:
            plan = batch.memo[LinearPlan] = LinearPlan(batch)
        return plan  # type: ignore[return-value]


class GatedDeltaNet(nn.Module):
    """The linear-attention token mixer: [T, hidden] -> [T, hidden], its request states in `kv`."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        c = config
        self.config = config
        self.hk, self.hv = c.linear_num_key_heads, c.linear_num_value_heads
        self.dk, self.dv = c.linear_key_head_dim, c.linear_value_head_dim
        conv_dim, value_dim = c.linear_conv_dim, self.hv * self.dv
        self.in_proj_qkv = linear(c.hidden_size, conv_dim, False, dtype, device)
        self.in_proj_z = linear(c.hidden_size, value_dim, False, dtype, device)
        self.in_proj_b = linear(c.hidden_size, self.hv, False, dtype, device, quantizable=False)
        self.in_proj_a = linear(c.hidden_size, self.hv, False, dtype, device, quantizable=False)
        self.conv1d = ConvWeight(conv_dim, c.linear_conv_kernel_dim, dtype, device)
        self.dt_bias = nn.Parameter(torch.empty(self.hv, dtype=dtype, device=device))
        self.A_log = nn.Parameter(torch.empty(self.hv, dtype=dtype, device=device))
        self.norm = GatedRMSNorm(self.dv, c.rms_norm_eps, dtype, device)
        self.out_proj = linear(value_dim, c.hidden_size, False, dtype, device)

    def forward(self, x: torch.Tensor, layer: int, batch: ForwardBatch, kv: KVTensors) -> torch.Tensor:
        T = x.shape[0]
        plan = LinearPlan.of(batch)
        conv_state, state = kv.conv[layer], kv.recurrent[layer]  # [S + 1, C, K - 1], [S + 1, Hv, Dk, Dv]
        if conv_state is None or state is None:
            raise ValueError(f"layer {layer} is a linear-attention layer but the KV tensors hold no state for it")
        if plan.fresh:
            conv_state[plan.fresh] = 0
            state[plan.fresh] = 0
        mixed = self.in_proj_qkv(x)  # [T, C]
        weight = self.conv1d.weight[:, 0, :]  # [C, K]
        conv = torch.empty(mixed.shape, dtype=torch.float32, device=x.device)  # [T, C]
        for a, b, slot in plan.chunks:
            conv[a:b], conv_state[slot] = causal_conv1d(mixed[a:b], conv_state[slot], weight)
        rows, slots = plan.decode_rows, plan.decode_slots
        if rows.numel():
            conv[rows] = causal_conv1d_step_(mixed[rows], conv_state, weight, slots)
        conv = F.silu(conv)
        kd = self.hk * self.dk
        q = l2norm(conv[:, :kd].view(T, self.hk, self.dk)) * self.dk**-0.5  # [T, Hk, Dk]
        k = l2norm(conv[:, kd : 2 * kd].view(T, self.hk, self.dk))
        v = conv[:, 2 * kd :].view(T, self.hv, self.dv)  # [T, Hv, Dv]
        beta = torch.sigmoid(self.in_proj_b(x).float())  # [T, Hv]
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias.float())  # [T, Hv]
        out = torch.empty(T, self.hv, self.dv, dtype=torch.float32, device=x.device)  # [T, Hv, Dv]
        per_key = self.hv // self.hk  # each key head serves per_key consecutive value heads
        for a, b, slot in plan.chunks:
            qc, kc = q[a:b].repeat_interleave(per_key, dim=1), k[a:b].repeat_interleave(per_key, dim=1)  # [n, Hv, Dk]
            out[a:b], state[slot] = chunk_gated_delta_rule(qc, kc, v[a:b], g[a:b], beta[a:b], state[slot])
        if rows.numel():
            out[rows] = recurrent_gated_delta_(q[rows], k[rows], v[rows], g[rows], beta[rows], state, slots)
        z = self.in_proj_z(x).view(T, self.hv, self.dv)  # [T, Hv, Dv]
        y = self.norm(out.to(x.dtype), z)  # [T, Hv, Dv]
        return self.out_proj(y.reshape(T, self.hv * self.dv))  # [T, hidden]


class Qwen3_5MoE(Qwen3MoE):
    """Qwen3-MoE's router and experts plus a shared expert gated by sigmoid(shared_expert_gate(x))."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__(config, dtype, device)
        c = config
        self.shared_expert = GatedMLP(
            c.hidden_size, c.shared_expert_intermediate_size, c.hidden_act, False, dtype, device
        )
        self.shared_expert_gate = linear(c.hidden_size, 1, False, dtype, device, quantizable=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]."""
        return super().forward(x) + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


class Qwen3_5Block(nn.Module):
    """Pre-norm: x + mixer(norm(x)), then + mlp(norm(x)); the mixer is linear or gated attention."""

    def __init__(self, config: ModelConfig, layer: int, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        c = config
        self.linear = c.layer_types[layer] == LINEAR_ATTENTION
        self.input_layernorm = unit_norm(c.hidden_size, c.rms_norm_eps, dtype, device)
        if self.linear:
            self.linear_attn = GatedDeltaNet(c, dtype, device)
        else:
            self.self_attn = GatedAttention(c, dtype, device)
        self.post_attention_layernorm = unit_norm(c.hidden_size, c.rms_norm_eps, dtype, device)
        if c.num_experts and layer not in c.dense_mlp_layers:
            self.mlp: nn.Module = Qwen3_5MoE(c, dtype, device)
        else:
            self.mlp = GatedMLP(c.hidden_size, c.intermediate_size, c.hidden_act, False, dtype, device)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layer: int, batch: ForwardBatch, kv: KVTensors
    ) -> torch.Tensor:
        h = self.input_layernorm(x)
        if self.linear:
            h = self.linear_attn(h, layer, batch, kv)
        else:
            h = self.self_attn(h, cos, sin, layer, batch, kv)
        x, y = residual(x, h, None, self.post_attention_layernorm)
        return x + self.mlp(y)


_IGNORED = ("mtp.", "model.visual.", "model.mtp.", "visual.")


class Qwen3_5ForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        c = config
        self.config = config
        self.embed_tokens = embedding(c.vocab_size, c.hidden_size, dtype, device)
        self.layers = nn.ModuleList(Qwen3_5Block(c, i, dtype, device) for i in range(c.num_layers))
        self.norm = unit_norm(c.hidden_size, c.rms_norm_eps, dtype, device)
        self.lm_head = None if c.tie_word_embeddings else linear(c.hidden_size, c.vocab_size, False, dtype, device)
        factor = c.rope_full.partial_rotary_factor or 1.0
        self.rotary = Rotary(c.rope_full, int(c.head_dim * factor), device)  # tables over the rotated channels

    def _local(self, name: str) -> str | None:
        if name.startswith(_IGNORED):
            return None  # the vision tower and the multi-token-prediction head
        if name == "lm_head.weight" and self.lm_head is None:
            return None  # tied: the embedding is the head
        return strip_prefix(name, ("model.language_model.", "model."))

    def load_weights(
        self, tensors: MutableMapping[str, Weight], weights: str = "auto", prefill_weights: str = "quantized"
    ) -> None:
        """Load HF-named tensors (`model.layers.0.linear_attn.in_proj_qkv.weight`, ...); `weights`
        is the `--weights` policy (routers, gates and norms stay float)."""
        c = self.config
        rest: dict[str, Weight] = {}
        for name, t in take_all(tensors).items():
            local = self._local(name)
            if local is not None:
                rest[local] = t
        for i in c.linear_layers:
            _split_fused_projections(rest, f"layers.{i}.linear_attn.", c)
        for i, layer in enumerate(self.layers):
            if isinstance(layer.mlp, Qwen3_5MoE):
                prefix = f"layers.{i}.mlp.experts."
                layer.mlp.experts.load(*take_experts(rest, prefix, c.num_experts, c.moe_intermediate_size, weights))
        load_named(self, rest, lambda name: name, weights, prefill_weights)

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch, kv: KVTensors) -> torch.Tensor:
        """input_ids [T] -> logits [N, vocab] for the rows batch.logits_indices."""
        x = self.embed_tokens(input_ids)  # [T, hidden]
        cos, sin = self.rotary.cos_sin(batch.positions)  # [T, R / 2] each, float32
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, i, batch, kv)
        return output_logits(x, batch, self.norm, self.embed_tokens, self.lm_head)  # [N, vocab]


def _split_fused_projections(rest: dict[str, Weight], prefix: str, c: ModelConfig) -> None:
    """Qwen3-Next's fused linear-layer projections as Qwen3.5's, in place: `in_proj_qkvz` holds,
    for each key head g, its q rows (Dk), k rows (Dk), then the v rows and z rows (r Dv each) of
    its r = Hv / Hk value heads; `in_proj_ba` the b rows then the a rows (r each) of the same
    value heads. Qwen3.5 keeps [q of every key head | k ... | v ...], z, b and a apart, value heads
    in the same grouped order (transformers' `fix_query_key_value_ordering` read as row indices).
    Each is split where present (llama.cpp's converter writes q/k/v and z apart already, and b/a
    fused). A row is whole in every weight form, so quantized rows move as they are."""
    hk, dk, dv = c.linear_num_key_heads, c.linear_key_head_dim, c.linear_value_head_dim
    r = c.linear_num_value_heads // hk
    group = 2 * dk + 2 * r * dv  # rows per key head in in_proj_qkvz
    base = torch.arange(hk)[:, None]
    splits = {  # fused name -> (its rows, {Qwen3.5 name: its rows in the fused weight})
        "in_proj_qkvz": (
            hk * group,
            {
                "in_proj_qkv": torch.cat(
                    [
                        (base * group + torch.arange(dk)).flatten(),
                        (base * group + dk + torch.arange(dk)).flatten(),
                        (base * group + 2 * dk + torch.arange(r * dv)).flatten(),
                    ]
                ),
                "in_proj_z": (base * group + 2 * dk + r * dv + torch.arange(r * dv)).flatten(),
            },
        ),
        "in_proj_ba": (
            hk * 2 * r,
            {
                "in_proj_b": (base * 2 * r + torch.arange(r)).flatten(),
                "in_proj_a": (base * 2 * r + r + torch.arange(r)).flatten(),
            },
        ),
    }
    for fused_name, (expected, parts) in splits.items():
        fused = rest.pop(f"{prefix}{fused_name}.weight", None)
        if fused is None:
            continue
        if fused.shape[0] != expected:
            raise ModelLoadError(f"{prefix}{fused_name}: {fused.shape[0]} rows, the config implies {expected}")
        for name, index in parts.items():
            rest[f"{prefix}{name}.weight"] = (
                fused.index_select(0, index)
                if isinstance(fused, torch.Tensor)
                else fused.map_rows(lambda t, i=index: t[i])
            )


# --- reading config.json -------------------------------------------------------------------------


_DEFAULTS = dict(
    vocab_size=248_320,
    hidden_size=4096,
    intermediate_size=12_288,
    num_hidden_layers=32,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=256,
    rms_norm_eps=1e-6,
    max_position_embeddings=32_768,
    tie_word_embeddings=False,
    attention_bias=False,
    bos_token_id=None,
    eos_token_id=None,
)
_MOE_DEFAULTS = dict(_DEFAULTS, hidden_size=2048, num_hidden_layers=40, num_key_value_heads=2, intermediate_size=0)
# transformers' Qwen3NextConfig defaults
_NEXT_DEFAULTS = dict(_MOE_DEFAULTS, vocab_size=151_936, num_hidden_layers=48, intermediate_size=5632)


def _text_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The text model's dict: a multimodal checkpoint's `text_config` (its `tie_word_embeddings`
    where the text config has none), or the dict itself."""
    text = config.get("text_config")
    if config.get("model_type") in ("qwen3_5", "qwen3_5_moe") and isinstance(text, Mapping):
        out = dict(text)
        if out.get("tie_word_embeddings") is None and config.get("tie_word_embeddings") is not None:
            out["tie_word_embeddings"] = config["tie_word_embeddings"]
        return out
    return dict(config)


def _rope(config: Mapping[str, Any]) -> RopeConfig:
    """The one rope: default type over the first `partial_rotary_factor` (0.25) of each head."""
    rope = read_single_rope(config, 10_000.0)
    if rope.partial_rotary_factor is None:
        factor = float(hf_get(config, "partial_rotary_factor", 0.25))
        rope = RopeConfig(**{**rope.__dict__, "partial_rotary_factor": factor})
    if rope.rope_type != "default":
        raise ModelLoadError(f"qwen3_5 with rope type {rope.rope_type!r} is not supported")
    return rope


def config_from_hf(config: Mapping[str, Any]) -> ModelConfig:
    """A Qwen3.5 / Qwen3.5-MoE / Qwen3-Next `config.json` dict (model_type "qwen3_5",
    "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next") as a ModelConfig."""
    model_type = str(config.get("model_type", ""))
    nxt = model_type == "qwen3_next"
    moe = nxt or model_type.startswith("qwen3_5_moe")
    text = _text_config(config)
    common = read_common(text, _NEXT_DEFAULTS if nxt else _MOE_DEFAULTS if moe else _DEFAULTS)
    n = common["num_layers"]
    interval = int(hf_get(text, "full_attention_interval", 4))
    layer_types = tuple(
        text.get("layer_types") or [FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(n)]
    )
    bad = sorted(set(layer_types) - {FULL_ATTENTION, LINEAR_ATTENTION})
    if bad:
        raise ModelLoadError(f"qwen3_5 with layer types {bad} is not supported")
    rope = _rope(text)
    extra: dict[str, Any] = {}
    if moe:
        extra = dict(
            num_experts=int(hf_get(text, "num_experts", 512 if nxt else 256)),
            num_experts_per_tok=int(hf_get(text, "num_experts_per_tok", 10 if nxt else 8)),
            moe_intermediate_size=int(hf_get(text, "moe_intermediate_size", 512)),
            shared_expert_intermediate_size=int(hf_get(text, "shared_expert_intermediate_size", 512)),
            # transformers' Qwen3.5-MoE router always renormalises the top k; Qwen3-Next's when told
            norm_topk_prob=bool(hf_get(text, "norm_topk_prob", True)) if nxt else True,
        )
    if nxt:  # Qwen3-Next's dense layers: listed, or off the sparse step, or every layer without experts
        step = int(hf_get(text, "decoder_sparse_step", 1))
        only = {int(i) for i in text.get("mlp_only_layers") or ()}
        experts = extra["num_experts"]
        extra["dense_mlp_layers"] = tuple(
            i for i in range(n) if i in only or experts == 0 or step <= 0 or (i + 1) % step != 0
        )
        if str(hf_get(text, "hidden_act", "silu")) != "silu":
            raise ModelLoadError("qwen3_next with a hidden_act other than silu is not supported")
    return ModelConfig(
        architecture="qwen3_next" if nxt else "qwen3_5_moe" if moe else "qwen3_5",
        **common,
        layer_types=layer_types,
        rope_full=rope,
        rope_sliding=rope,
        hidden_act=str(hf_get(text, "hidden_act", "silu")),
        attn_output_gate=True,
        linear_num_key_heads=int(hf_get(text, "linear_num_key_heads", 16)),
        linear_num_value_heads=int(hf_get(text, "linear_num_value_heads", 32)),
        linear_key_head_dim=int(hf_get(text, "linear_key_head_dim", 128)),
        linear_value_head_dim=int(hf_get(text, "linear_value_head_dim", 128)),
        linear_conv_kernel_dim=int(hf_get(text, "linear_conv_kernel_dim", 4)),
        **extra,
    )
