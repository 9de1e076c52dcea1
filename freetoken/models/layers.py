"""Building blocks shared by the model families: norms, rotary embeddings, MLPs, weight loading.

Owns the numerics that must match transformers bit for bit where it matters (rope tables in
float32, norms in at least float32) and the step every attention layer takes: store this step's
K/V in its pool, then attend over the pages. It does not know any family's layer layout.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, MutableMapping

import torch
import torch.nn.functional as F
from torch import nn

from freetoken.attention import attention_fn
from freetoken.attention.metadata import ForwardBatch
from freetoken.errors import ModelLoadError
from freetoken.kv.tensors import KVTensors
from freetoken.models.config import ModelConfig, RopeConfig
from freetoken.models.linear import (
    Embedding,
    Linear,
    QuantizableWeight,
    Weight,
    apply_policy,
    check_policy,
    keeps_dense_copy,
)
from freetoken.ops.layers import add_rms_norm, gated_act, qk_norm_rope_, rms_norm, rope_
from freetoken.ops.quantized import concat, dequantize, is_quantized


# compute_dtype of the usual dtypes, looked up (a few times per layer and step) rather than promoted.
_COMPUTE_DTYPES = {
    dtype: torch.promote_types(dtype, torch.float32)
    for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float64)
}


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half types, the dtype itself for float32 / float64."""
    return _COMPUTE_DTYPES.get(dtype) or torch.promote_types(dtype, torch.float32)


def linear(
    n_in: int, n_out: int, bias: bool, dtype: torch.dtype, device: torch.device | str, quantizable: bool = True
) -> Linear:
    """An uninitialised linear layer (weights come from the checkpoint, float or quantized)."""
    return Linear(n_in, n_out, bias, dtype, device, quantizable)


def embedding(n: int, dim: int, dtype: torch.dtype, device: torch.device | str) -> Embedding:
    return Embedding(n, dim, dtype, device)


class RMSNorm(nn.Module):
    """x / rms(x) * w, computed in at least float32.

    `unit_offset`: Gemma's form, scaled by (1 + w). `scale_in_float`: multiply by the weight before
    casting back (Gemma, gpt-oss) rather than after (Llama); the two differ only in half types.
    """

    def __init__(
        self,
        dim: int,
        eps: float,
        dtype: torch.dtype,
        device: torch.device | str,
        unit_offset: bool = False,
        scale_in_float: bool = False,
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype, device=device))
        self.eps = eps
        self.unit_offset = unit_offset
        self.scale_in_float = scale_in_float
        self.after_cast = not (scale_in_float or unit_offset)  # Llama's form: `ops.layers.rms_norm`
        # (the Parameter, its version, the dtype) the float weight was made from, and that weight.
        self._cached: tuple[nn.Parameter, int, torch.dtype, torch.Tensor] | None = None

    def _float_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight as multiplied in `dtype` ((1 + w) for Gemma), made once per loaded value.

        Called several times per layer and step, so the Parameter is read from `_parameters`
        directly: `self.weight` goes through nn.Module.__getattr__ (~0.45 us a lookup)."""
        weight = self._parameters["weight"]
        cached = self._cached
        if cached is None or cached[0] is not weight or cached[1] != weight._version or cached[2] != dtype:
            w = weight.detach().to(dtype)
            cached = self._cached = (weight, weight._version, dtype, 1.0 + w if self.unit_offset else w)
        return cached[3]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., D] -> the same shape and dtype (one fused op on CPU: `ops.layers.rms_norm`)."""
        return rms_norm(x, self._float_weight(compute_dtype(x.dtype)), self.eps, self.after_cast)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """`forward` without nn.Module's hook dispatch (~0.6 us a call, a few norms per layer and
        step). Nothing hooks a norm: tensor parallelism hooks whole attention and MLP blocks."""
        return self.forward(x)


def residual(
    x: torch.Tensor, h: torch.Tensor, h_norm: RMSNorm | None, next_norm: RMSNorm | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The residual step between sub-blocks as one op: x + h_norm(h) (x + h without h_norm), and
    next_norm of that sum (None without next_norm). x, h [T, D]. Both norms share eps and form."""
    first = h_norm if h_norm is not None else next_norm
    if first is None:
        return x + h, None
    dtype = compute_dtype(x.dtype)
    return add_rms_norm(
        x,
        h,
        h_norm._float_weight(dtype) if h_norm is not None else None,
        next_norm._float_weight(dtype) if next_norm is not None else None,
        first.eps,
        first.after_cast,
    )


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

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> cos, sin [T, D / 2] in float32, made once per step for every layer."""
        freqs = positions[:, None].float() * self.inv_freq[None, :]  # [T, D / 2]
        cos = freqs.cos() * self.attention_scaling
        sin = freqs.sin() * self.attention_scaling
        return cos, sin


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the two halves (x1, x2) of each head of x [T, heads, D] into (x1 c - x2 s,
    x2 c + x1 s) by cos, sin [T, D / 2] from `Rotary.cos_sin`, in place (x is a fresh
    projection output); returns x."""
    return rope_(x, cos, sin)


def rotate_partial_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first R channels of each head of x [T, H, D] (halves of R paired) by cos, sin
    [T, R / 2] in place; the other D - R channels pass. Returns x."""
    r = 2 * cos.shape[-1]
    dtype = compute_dtype(x.dtype)
    x1, x2 = x[..., : r // 2].to(dtype), x[..., r // 2 : r].to(dtype)  # [T, H, R / 2] each
    c, s = cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]  # [T, 1, R / 2]
    x[..., :r] = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)
    return x


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
}
_FUSED_ACTS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)), the Llama / Gemma feed-forward."""

    def __init__(
        self, hidden: int, intermediate: int, act: str, bias: bool, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        super().__init__()
        if act not in ACTIVATIONS:
            raise ModelLoadError(f"unsupported activation {act!r}")
        self.act = ACTIVATIONS[act]
        self.fused_act = _FUSED_ACTS.get(act)  # the name `ops.layers.gated_act` knows it by, if any
        self.intermediate = intermediate
        self.gate_up_proj = linear(hidden, 2 * intermediate, bias, dtype, device)  # gate rows, then up rows
        self.down_proj = linear(intermediate, hidden, bias, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [T, 2 inter]: gate, then up
        if self.fused_act is not None and gate_up.dim() == 2:
            return self.down_proj(gated_act(gate_up, self.fused_act))
        gate, up = gate_up.split(self.intermediate, dim=-1)  # [T, inter] each
        return self.down_proj(self.act(gate) * up)


def qkv_linear(config: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> Linear:
    """The fused q/k/v projection: q rows, then k rows, then v rows."""
    c = config
    return linear(c.hidden_size, (c.num_heads + 2 * c.num_kv_heads) * c.head_dim, c.attention_bias, dtype, device)


def split_qkv(qkv: torch.Tensor, config: ModelConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[T, (H + 2 n_kv) D] -> q [T, H, D], k [T, n_kv, D], v [T, n_kv, D] (views)."""
    c = config
    heads = qkv.view(qkv.shape[0], c.num_heads + 2 * c.num_kv_heads, c.head_dim)  # [T, H + 2 n_kv, D]
    # One op for the three views (a split along the last dimension, then three views, cost twice as much).
    q, k, v = heads.split_with_sizes((c.num_heads, c.num_kv_heads, c.num_kv_heads), dim=1)
    return q, k, v


def attention_inputs(
    qkv: torch.Tensor,
    config: ModelConfig,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_norm: RMSNorm | None = None,
    k_norm: RMSNorm | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused projection [T, (H + 2 n_kv) D] -> q [T, H, D], k, v [T, n_kv, D], with the query
    and key heads normed (Gemma's q/k norms, when given) and rotated: one op on CPU."""
    c = config
    norm = q_norm or k_norm
    dtype = compute_dtype(qkv.dtype)
    qw = q_norm._float_weight(dtype) if q_norm is not None else None
    kw = k_norm._float_weight(dtype) if k_norm is not None else None
    fused = qkv_fusable(q_norm, k_norm) and qk_norm_rope_(
        qkv,
        c.num_heads,
        c.num_kv_heads,
        qw,
        kw,
        norm.eps if norm else 0.0,
        norm.after_cast if norm else False,
        cos,
        sin,
    )
    q, k, v = split_qkv(qkv, c)
    if not fused:
        if q_norm is not None:
            q = q_norm(q)
        if k_norm is not None:
            k = k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    return q, k, v


def qkv_fusable(q_norm: RMSNorm | None, k_norm: RMSNorm | None) -> bool:
    """Whether both norms (those given) share eps and form, as the fused op assumes."""
    if q_norm is None or k_norm is None:
        return True
    return q_norm.eps == k_norm.eps and q_norm.after_cast == k_norm.after_cast


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
        q,
        kv.k[layer],
        kv.v[layer],
        table,
        batch,
        scale=config.attention_scale,
        sliding_window=config.sliding_window if sliding else None,
        sinks=sinks,
        softcap=config.attn_logit_softcapping,
    )


# Projections run as one matrix: the parts' rows stacked in this order under the fused name.
FUSED: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}
_FUSED_INTO: dict[str, str] = {part: fused for fused, parts in FUSED.items() for part in parts}


class SelfAttention(nn.Module):
    """Fused-QKV self-attention over the paged cache, with optional per-head RMSNorms on the
    queries and keys before rope (Gemma 3, Qwen3; Llama has none). Parameter names follow
    transformers' (`qkv_proj` fused at load, `o_proj`, `q_norm`, `k_norm`). A family that also
    transforms the values (Gemma 4 norms them) overrides `values`."""

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        device: torch.device | str,
        q_norm: RMSNorm | None = None,
        k_norm: RMSNorm | None = None,
    ) -> None:
        super().__init__()
        c = config
        self.config = config
        self.qkv_proj = qkv_linear(c, dtype, device)
        o_bias = c.attention_bias if c.o_proj_bias is None else c.o_proj_bias
        self.o_proj = linear(c.num_heads * c.head_dim, c.hidden_size, o_bias, dtype, device)
        self.q_norm, self.k_norm = q_norm, k_norm

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layer: int, batch: ForwardBatch, kv: KVTensors
    ) -> torch.Tensor:
        c = self.config
        T = x.shape[0]
        qkv = self.qkv_proj(x)  # [T, (H + 2 n_kv) D]
        q, k, v = attention_inputs(qkv, c, cos, sin, self.q_norm, self.k_norm)  # [T, H, D], [T, n_kv, D] x 2
        out = paged_self_attention(q, k, self.values(v), layer, c, batch, kv)  # [T, H, D]
        return self.o_proj(out.reshape(T, c.num_heads * c.head_dim))  # [T, hidden]

    def values(self, v: torch.Tensor) -> torch.Tensor:
        """v [T, n_kv, D] as it is stored and attended."""
        return v


def _stack(parts: list[Weight]) -> Weight:
    """Rows of `parts` stacked; all-quantized parts stay quantized, a mix becomes float."""
    if all(is_quantized(p) for p in parts):
        return concat(parts)  # type: ignore[arg-type]
    floats = [dequantize(p, torch.float32) if is_quantized(p) else p for p in parts]
    dtype = functools.reduce(torch.promote_types, (f.dtype for f in floats))
    return torch.cat([f.to(dtype) for f in floats])


def fuse_projections(tensors: Mapping[str, Weight], fused_names: set[str]) -> dict[str, Weight]:
    """`...q_proj.weight`, `...k_proj.weight`, `...v_proj.weight` -> `...qkv_proj.weight` (and
    gate/up, and biases alike) for the fused modules named in `fused_names`; other tensors, and
    parts whose group is incomplete, pass through under their own names."""
    out: dict[str, Weight] = {}
    groups: dict[str, dict[str, Weight]] = {}
    for name, t in tensors.items():
        module, _, leaf = name.rpartition(".")
        parent, _, proj = module.rpartition(".")
        fused = _FUSED_INTO.get(proj)
        target = f"{parent}.{fused}" if parent else str(fused)
        if fused is None or target not in fused_names:
            out[name] = t
            continue
        groups.setdefault(f"{target}.{leaf}", {})[proj] = t
    for key, parts in groups.items():
        module, _, leaf = key.rpartition(".")
        parent, _, fused = module.rpartition(".")
        order = FUSED[fused]
        if set(parts) == set(order):
            out[key] = _stack([parts[p] for p in order])
        else:
            prefix = f"{parent}." if parent else ""
            out.update({f"{prefix}{p}.{leaf}": t for p, t in parts.items()})
    return out


def take_all(tensors: MutableMapping[str, Weight]) -> dict[str, Weight]:
    """Everything in `tensors`, which is left empty: a loader that takes a checkpoint's mapping
    this way holds the only reference to each matrix, so dropping it once placed frees it."""
    out = dict(tensors)
    tensors.clear()
    return out


def load_named(
    module: nn.Module,
    tensors: MutableMapping[str, Weight],
    rename: Callable[[str], str | None],
    weights: str = "auto",
    prefill_weights: str = "quantized",
) -> None:
    """Copy checkpoint tensors into `module`'s parameters, each HF name mapped by `rename`
    (None: a tensor the model knowingly ignores), q/k/v and gate/up parts stacked into the
    model's fused projections, and each quantizable matrix loaded as the `weights` policy says
    (`models.linear.apply_policy`); `prefill_weights` says which quantized linear layers also keep
    a dequantized copy for prefill (`models.linear.keeps_dense_copy`). Raises ModelLoadError
    naming the missing, unexpected or mis-shaped tensors.

    Takes `tensors` over: the mapping is left empty, and each matrix is dropped as soon as it is
    copied or packed, so the checkpoint's matrices are freed one by one and the load's peak stays
    near the kept weights rather than kept weights + the whole checkpoint. Pass a copy to keep yours."""
    check_policy(weights)
    params = dict(module.named_parameters())
    modules = dict(module.named_modules())
    renamed: dict[str, Weight] = {}
    checkpoint_name: dict[str, str] = {}  # local name -> the checkpoint's, for messages
    for name, tensor in take_all(tensors).items():
        local = rename(name)
        if local is not None:
            renamed[local] = tensor
            checkpoint_name[local] = name
    loaded: set[str] = set()
    unexpected: list[str] = []
    with torch.no_grad():
        fused = fuse_projections(renamed, set(modules))
        renamed.clear()
        while fused:
            local = next(iter(fused))
            tensor = fused.pop(local)  # the only reference from here on: freed once placed
            param = params.get(local)
            if param is None:
                unexpected.append(checkpoint_name.get(local, local))
                continue
            shape = tuple(tensor.shape)  # a QuantizedWeight's shape is its matrix's
            if tuple(param.shape) != shape:
                name = checkpoint_name.get(local, local)
                raise ModelLoadError(f"tensor {name} has shape {shape}, the model expects {tuple(param.shape)}")
            owner_name, _, leaf = local.rpartition(".")
            owner = modules.get(owner_name)
            if isinstance(owner, QuantizableWeight) and owner.quantizable and leaf == "weight":
                tensor = apply_policy(tensor, weights)
                if is_quantized(tensor):
                    owner.load_quantized(tensor)
                    if keeps_dense_copy(prefill_weights, owner, local):
                        owner.keep_dense_copy()
                    loaded.add(local)
                    continue
            if is_quantized(tensor):
                tensor = dequantize(tensor, torch.float32)
            param.copy_(tensor)
            loaded.add(local)
    missing = sorted(set(params) - loaded)
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing tensors: {', '.join(missing[:10])}{' ...' if len(missing) > 10 else ''}")
        if unexpected:
            parts.append(
                f"unexpected tensors: {', '.join(sorted(unexpected)[:10])}{' ...' if len(unexpected) > 10 else ''}"
            )
        raise ModelLoadError("; ".join(parts))


def strip_prefix(name: str, prefixes: tuple[str, ...]) -> str:
    """The name without the first of `prefixes` it starts with."""
    for prefix in prefixes:
        if name.startswith(prefix):
            return name[len(prefix) :]
    return name


def output_logits(
    x: torch.Tensor,
    batch: ForwardBatch,
    norm: nn.Module,
    embed_tokens: Embedding,
    lm_head: Linear | None,
    softcap: float | None = None,
) -> torch.Tensor:
    """The final norm and the output projection, for the rows that need logits only.

    x [T, hidden] -> logits [N, vocab] for `batch.logits_indices`; a missing `lm_head` means tied
    embeddings; `softcap` is Gemma's final soft-capping.
    """
    x = norm(x[batch.logits_indices])  # [N, hidden]
    logits = (embed_tokens if lm_head is None else lm_head).project(x)  # [N, vocab]
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return logits.to(compute_dtype(logits.dtype))
