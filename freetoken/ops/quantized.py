"""The canonical form of a weight-only quantized matrix: the contract between the weight loaders
and the ops. It owns the math of the format (quantize, dequantize, concatenate) in plain torch, on
any device; it knows no kernel layout (qlinear.py packs) and no file format (the GGUF loader
converts its block types into this form).

    w[n, k] = q[n, k] * scale[n, k // GROUP] + (minimum[n, k // GROUP] if minimum is not None else 0)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GROUP = 32


@dataclass
class QuantizedWeight:
    bits: int  # 8 or 4
    q: torch.Tensor  # int8 [N, K]; bits=8: any int8 value; bits=4: values in [0, 15]
    scale: torch.Tensor  # float16 [N, K // GROUP]
    minimum: torch.Tensor | None  # float16 [N, K // GROUP], or None (symmetric)

    def __post_init__(self) -> None:
        n, k = self.q.shape
        if self.bits not in (4, 8) or k % GROUP or self.q.dtype != torch.int8:
            raise ValueError(f"QuantizedWeight: bits={self.bits}, q {self.q.dtype} {tuple(self.q.shape)}")
        for t in (self.scale, self.minimum):
            if t is not None and (t.dtype != torch.float16 or tuple(t.shape) != (n, k // GROUP)):
                raise ValueError(f"QuantizedWeight: scale/minimum must be float16 [{n}, {k // GROUP}]")

    @property
    def shape(self) -> tuple[int, int]:
        return (self.q.shape[0], self.q.shape[1])


def _groups(w: torch.Tensor) -> torch.Tensor:
    n, k = w.shape
    if k % GROUP:
        raise ValueError(f"in_features {k} is not a multiple of {GROUP}")
    return w.float().reshape(n, k // GROUP, GROUP)  # [N, G, 32]


def quantize_int8(w: torch.Tensor) -> QuantizedWeight:
    """Symmetric absmax per group (like GGUF Q8_0): q in [-127, 127], scale = absmax / 127.
    |w - dequantize| <= scale / 2 (+ the float16 rounding of the scale, <= 127 * scale * 2**-11)."""
    g = _groups(w)
    scale = (g.abs().amax(dim=2) / 127.0).half()  # [N, G]
    s = scale.float().unsqueeze(2)
    q = torch.where(s > 0, g / s.clamp_min(torch.finfo(torch.float32).tiny), 0.0)
    q = q.round().clamp(-127, 127).to(torch.int8).reshape(w.shape)
    return QuantizedWeight(bits=8, q=q, scale=scale, minimum=None)


def quantize_int4(w: torch.Tensor) -> QuantizedWeight:
    """Asymmetric per group (like GGUF Q4_1): q in [0, 15], minimum = group min, scale = range / 15.
    |w - dequantize| <= scale / 2 (+ the float16 rounding of scale and minimum)."""
    g = _groups(w)
    lo, hi = g.amin(dim=2), g.amax(dim=2)
    scale, minimum = ((hi - lo) / 15.0).half(), lo.half()
    s, m = scale.float().unsqueeze(2), minimum.float().unsqueeze(2)
    q = torch.where(s > 0, (g - m) / s.clamp_min(torch.finfo(torch.float32).tiny), 0.0)
    q = q.round().clamp(0, 15).to(torch.int8).reshape(w.shape)
    return QuantizedWeight(bits=4, q=q, scale=scale, minimum=minimum)


def dequantize(qw: QuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The reference: float32 math, then one rounding to `dtype`. [N, K]."""
    n, k = qw.q.shape
    w = qw.q.float().reshape(n, k // GROUP, GROUP) * qw.scale.float().unsqueeze(2)  # [N, G, 32]
    if qw.minimum is not None:
        w = w + qw.minimum.float().unsqueeze(2)
    return w.reshape(n, k).to(dtype)


def concat(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """Stack along N (fused QKV, gate/up). Mixed bits promote the 4-bit parts to 8-bit exactly (q in
    [0, 15] with its scale and minimum is a valid bits=8 weight); if any part has a minimum, the
    symmetric parts get a zero minimum (exact)."""
    if not parts:
        raise ValueError("concat of no weights")
    if len({p.q.shape[1] for p in parts}) != 1:
        raise ValueError(f"concat: in_features differ: {[p.q.shape[1] for p in parts]}")
    bits = max(p.bits for p in parts)
    any_min = any(p.minimum is not None for p in parts)
    minimum = (
        torch.cat([p.minimum if p.minimum is not None else torch.zeros_like(p.scale) for p in parts])
        if any_min
        else None
    )
    return QuantizedWeight(
        bits=bits,
        q=torch.cat([p.q for p in parts]),
        scale=torch.cat([p.scale for p in parts]),
        minimum=minimum,
    )
