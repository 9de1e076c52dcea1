"""Building blocks shared by the model families: norms, rotary embeddings, MLPs, weight loading.

Owns the numerics that must match transformers bit for bit where it matters (rope tables in
float32, norms in at least float32) and the step every attention layer takes: store this step's
K/V in its pool, then attend over the pages. It does not know any family's layer layout.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from freetoken.attention import attention_fn
from freetoken.attention.metadata import ForwardBatch
from freetoken.errors import ModelLoadError
from freetoken.kv.tensors import KVTensors
from freetoken.models.config import ModelConfig, RopeConfig


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half types, the dtype itself for float32 / float64."""
    return torch.promote_types(dtype, torch.float32)


def linear(n_in: int, n_out: int, bias: bool, dtype: torch.dtype, device: torch.device | str) -> nn.Linear:
    """An uninitialised nn.Linear (weights come from the checkpoint)."""
    return nn.utils.skip_init(nn.Linear, n_in, n_out, bias=bias, dtype=dtype, device=device)


def embedding(n: int, dim: int, dtype: torch.dtype, device: torch.device | str) -> nn.Embedding:
    return nn.utils.skip_init(nn.Embedding, n, dim, dtype=dtype, device=device)


class RMSNorm(nn.Module):
    """x / rms(x) * w, computed in at least float32.

    `unit_offset`: Gemma's form, scaled by (1 + w). `scale_in_float`: multiply by the weight before
    casting back (Gemma, gpt-oss) rather than after (Llama); the two differ only in half types.
    """

    def __init__(
        self, dim: int, eps: float, dtype: torch.dtype, device: torch.device | str,
        unit_offset: bool = False, scale_in_float: bool = False,
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype, device=device))
        self.eps = eps
        self.unit_offset = unit_offset
        self.scale_in_float = scale_in_float

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.to(compute_dtype(x.dtype))
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        w = self.weight.to(xf.dtype)
        if self.unit_offset:
            w = 1.0 + w
        if self.scale_in_float:
            return (xf * w).to(x.dtype)
        return self.weight * xf.to(x.dtype)


def _yarn_inv_freq(rope: RopeConfig, dim: int, pos_freqs: torch.Tensor) -> tuple[torch.Tensor, float]:
    """YaRN: blend interpolated and extrapolated frequencies over a ramp of dimensions."""
    factor = rope.factor if rope.factor is not None else 1.0
    orig = rope.original_max_position_embeddings
    if orig is None:
        raise ModelLoadError("yarn rope needs original_max_position_embeddings")

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = rope.attention_factor
    if attention is None:
        if rope.mscale and rope.mscale_all_dim:
            attention = mscale(factor, rope.mscale) / mscale(factor, rope.mscale_all_dim)
        else:
            attention = mscale(factor)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast or 32.0), correction_dim(rope.beta_slow or 1.0)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp  # share of the unscaled frequency per dimension pair
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return inv_freq, float(attention)


def _llama3_inv_freq(rope: RopeConfig, inv_freq: torch.Tensor) -> torch.Tensor:
    factor, orig = rope.factor, rope.original_max_position_embeddings
    low_f, high_f = rope.low_freq_factor, rope.high_freq_factor
    if factor is None or orig is None or low_f is None or high_f is None:
        raise ModelLoadError("llama3 rope needs factor, low/high_freq_factor, original_max_position_embeddings")
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > orig / low_f, inv_freq / factor, inv_freq)
    smooth = (orig / wavelen - low_f) / (high_f - low_f)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < orig / high_f) & ~(wavelen > orig / low_f)
    return torch.where(medium, smoothed, scaled)


class Rotary:
    """Rotary embedding of one layer kind: inverse frequencies and cos/sin scale, in float32
    as transformers computes them (the tables are then cast to the model dtype)."""

    def __init__(self, rope: RopeConfig, head_dim: int, device: torch.device | str) -> None:
        pos_freqs = rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
        inv_freq = 1.0 / pos_freqs
        self.attention_scaling = 1.0
        if rope.rope_type == "linear":
            inv_freq = inv_freq / (rope.factor or 1.0)
        elif rope.rope_type == "llama3":
            inv_freq = _llama3_inv_freq(rope, inv_freq)
        elif rope.rope_type == "yarn":
            inv_freq, self.attention_scaling = _yarn_inv_freq(rope, head_dim, pos_freqs)
        self.inv_freq = inv_freq.to(device)  # [D / 2] float32

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> cos, sin [T, D / 2] in `dtype`."""
        freqs = positions[:, None].float() * self.inv_freq[None, :]  # [T, D / 2]
        cos = freqs.cos() * self.attention_scaling
        sin = freqs.sin() * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the two halves of x [T, heads, D] by cos, sin [T, D / 2]."""
    x1, x2 = x.chunk(2, dim=-1)  # each [T, heads, D / 2]
    cos, sin = cos[:, None, :], sin[:, None, :]  # [T, 1, D / 2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
}


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)), the Llama / Gemma feed-forward."""

    def __init__(
        self, hidden: int, intermediate: int, act: str, bias: bool, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        super().__init__()
        if act not in ACTIVATIONS:
            raise ModelLoadError(f"unsupported activation {act!r}")
        self.act = ACTIVATIONS[act]
        self.gate_proj = linear(hidden, intermediate, bias, dtype, device)
        self.up_proj = linear(hidden, intermediate, bias, dtype, device)
        self.down_proj = linear(intermediate, hidden, bias, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


def paged_self_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer: int,
    config: ModelConfig,
    batch: ForwardBatch,
    kv: KVTensors,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Store k, v [T, n_kv, D] of `layer` in its pool, then attend q [T, H, D] -> [T, H, D]."""
    sliding = config.is_sliding(layer)
    slots, table = (batch.swa_slots, batch.swa_table) if sliding else (batch.full_slots, batch.full_table)
    if slots is None or table is None:
        raise ValueError(f"layer {layer} is a sliding-window layer but the batch has no SWA table")
    kv.write(layer, slots, k, v)
    return attention_fn(q.device)(
        q, kv.k[layer], kv.v[layer], table, batch,
        scale=config.attention_scale,
        sliding_window=config.sliding_window if sliding else None,
        sinks=sinks,
        softcap=config.attn_logit_softcapping,
    )


def load_named(module: nn.Module, tensors: Mapping[str, torch.Tensor], rename: Callable[[str], str | None]) -> None:
    """Copy checkpoint tensors into `module`'s parameters, each HF name mapped by `rename`
    (None: a tensor the model knowingly ignores). Raises ModelLoadError naming the missing,
    unexpected or mis-shaped tensors."""
    params = dict(module.named_parameters())
    loaded: set[str] = set()
    unexpected: list[str] = []
    with torch.no_grad():
        for name, tensor in tensors.items():
            local = rename(name)
            if local is None:
                continue
            param = params.get(local)
            if param is None:
                unexpected.append(name)
                continue
            if tuple(param.shape) != tuple(tensor.shape):
                raise ModelLoadError(
                    f"tensor {name} has shape {tuple(tensor.shape)}, the model expects {tuple(param.shape)}"
                )
            param.copy_(tensor)
            loaded.add(local)
    missing = sorted(set(params) - loaded)
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing tensors: {', '.join(missing[:10])}{' ...' if len(missing) > 10 else ''}")
        if unexpected:
            parts.append(f"unexpected tensors: {', '.join(sorted(unexpected)[:10])}"
                         f"{' ...' if len(unexpected) > 10 else ''}")
        raise ModelLoadError("; ".join(parts))


def strip_prefix(name: str, prefixes: tuple[str, ...]) -> str:
    """The name without the first of `prefixes` it starts with."""
    for prefix in prefixes:
        if name.startswith(prefix):
            return name[len(prefix):]
    return name


def output_logits(
    x: torch.Tensor,
    batch: ForwardBatch,
    norm: nn.Module,
    embed_tokens: nn.Embedding,
    lm_head: nn.Linear | None,
    softcap: float | None = None,
) -> torch.Tensor:
    """The final norm and the output projection, for the rows that need logits only.

    x [T, hidden] -> logits [N, vocab] for `batch.logits_indices`; a missing `lm_head` means tied
    embeddings; `softcap` is Gemma's final soft-capping.
    """
    x = norm(x[batch.logits_indices])  # [N, hidden]
    head = embed_tokens.weight if lm_head is None else lm_head.weight
    logits = F.linear(x, head)  # [N, vocab]
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return logits.to(compute_dtype(logits.dtype))
