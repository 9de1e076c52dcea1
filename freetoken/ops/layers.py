"""RMSNorm and rotary embedding as single ops: the C++ kernels of csrc/layers.cpp on CPU for
bfloat16 / float32, torch's ops elsewhere (float64, other devices, no extension built).

Owns the choice and the exact arithmetic both paths share. Both compute in float32 (float64 for
float64 inputs) and round once to the input dtype:

- `rms_norm(x, w, eps)`: round(x / rms(x) * w); with `weight_after_cast` (Llama's form)
  round(round(x / rms(x)) * w), the weight then being the model-dtype values held in float32.
- `rope_(x, cos, sin)`: each head's halves (x1, x2) become (x1 c - x2 s, x2 c + x1 s), in place.
- `add_rms_norm(x, h, h_weight, weight, eps)`: the residual step between sub-blocks, x + norm(h)
  (or x + h) rounded as torch rounds each term, then the norm of the sum for the next sub-block.
- `gated_act(gate_up, act)`: act(gate) * up on the fused gate/up output (torch's ops; on CPU
  called from C++ as one call).
- `qk_norm_rope_(qkv, ...)`: a layer's query and key heads normed (optionally) and rotated in place
  in its fused projection output, the rounding of `rms_norm` then `rope_`.

transformers rounds the rotary tables to bfloat16 before multiplying in a bfloat16 model; here
the rotation is done in float32 and rounded once (a little closer to the float32 model). No
model or file knowledge here.
"""

from __future__ import annotations

import logging
from types import ModuleType

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)
_FAST_DTYPES = (torch.bfloat16, torch.float32)


def _load() -> ModuleType | None:
    try:
        from freetoken.ops import _layers_cpu  # built by `pip install -e .` (setup.py)
    except ImportError as err:
        log.info("freetoken.ops: C++ norm/rope kernels not built (%s); using torch", err)
        return None
    return _layers_cpu


_KERNEL: ModuleType | None = _load()  # decided once at import


def _fast(x: torch.Tensor) -> bool:
    # `is_cpu`, not `device.type`: these checks run a few times per layer and step, and making
    # the device object costs more than the check.
    return _KERNEL is not None and x.is_cpu and x.dtype in _FAST_DTYPES and x.stride(-1) == 1


def _float32_or_none(w: torch.Tensor | None) -> bool:
    return w is None or w.dtype == torch.float32


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, weight_after_cast: bool = False) -> torch.Tensor:
    """x [T, D] or [T, H, D] -> the same shape and dtype; `weight` [D] in x's compute dtype
    (float32 for bfloat16 / float32 inputs)."""
    if _fast(x) and x.dim() in (2, 3) and weight.dtype == torch.float32:
        return _KERNEL.rms_norm(x, weight, eps, weight_after_cast)  # type: ignore[union-attr]
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    normed = F.rms_norm(xf, (x.shape[-1],), None, eps)
    if weight_after_cast:
        return (normed.to(x.dtype) * weight.to(x.dtype)).to(x.dtype)
    return (normed * weight.to(normed.dtype)).to(x.dtype)


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, H, D] in place by cos, sin [T, D / 2] (float32) and return it."""
    if _fast(x) and x.dim() == 3:
        _KERNEL.rope_(x, cos, sin)  # type: ignore[union-attr]
        return x
    dtype = torch.promote_types(x.dtype, torch.float32)
    x1, x2 = x.to(dtype).chunk(2, dim=-1)  # each [T, H, D / 2]
    c, s = cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]  # [T, 1, D / 2]
    x.copy_(torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1))
    return x


# Rows up to which `add_rms_norm` is one C++ call (3.4 against 5.4 us at one row); its plain loop
# is slower than the two norm calls from ~16 rows (42 against 26 us).
ADD_NORM_MAX_ROWS = 4


def add_rms_norm(
    x: torch.Tensor,
    h: torch.Tensor,
    h_weight: torch.Tensor | None,
    weight: torch.Tensor | None,
    eps: float,
    weight_after_cast: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x_out = x + rms_norm(h, h_weight) (x + h without h_weight); y = rms_norm(x_out, weight)
    (None without weight). x, h [T, D]; weights [D] in the compute dtype."""
    if (
        _fast(x)
        and x.dim() == 2
        and x.shape[0] <= ADD_NORM_MAX_ROWS
        and x.is_contiguous()
        and h.is_contiguous()
        and h.dtype == x.dtype
        and _float32_or_none(h_weight)
        and _float32_or_none(weight)
    ):
        out = _KERNEL.add_rms_norm(x, h, h_weight, weight, eps, weight_after_cast)  # type: ignore[union-attr]
        return out[0], (out[1] if len(out) > 1 else None)
    if h_weight is not None:
        h = rms_norm(h, h_weight, eps, weight_after_cast)
    x = x + h
    return x, (rms_norm(x, weight, eps, weight_after_cast) if weight is not None else None)


_TORCH_ACTS = {"silu": F.silu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh")}
# Whether the built extension has `gated_act` (an older build does not).
_GATED_ACT = _KERNEL is not None and hasattr(_KERNEL, "gated_act")


def gated_act(gate_up: torch.Tensor, act: str) -> torch.Tensor:
    """gate_up [T, 2 I] (gate columns first) -> act(gate) * up [T, I]; act "silu" or "gelu_tanh".
    torch's vectorized ops (a C++ loop with libm's tanh was 3x slower even at one row); on CPU
    called from C++ in one call (the same kernels, the same bits, ~2 us less a call)."""
    if _GATED_ACT and gate_up.is_cpu and act in _TORCH_ACTS:
        return _KERNEL.gated_act(gate_up, act == "gelu_tanh")  # type: ignore[union-attr]
    gate, up = gate_up.chunk(2, dim=-1)
    return _TORCH_ACTS[act](gate) * up


def qk_norm_rope_(
    qkv: torch.Tensor,
    heads: int,
    kv_heads: int,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
    weight_after_cast: bool,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> bool:
    """Norm (where a weight is given) and rotate the query and key heads of qkv [T, (H + 2 n_kv) D]
    in place; False (nothing done) where only the caller's unfused path can run."""
    if not (_fast(qkv) and qkv.dim() == 2 and _float32_or_none(q_weight) and _float32_or_none(k_weight)):
        return False
    _KERNEL.qk_norm_rope_(qkv, heads, kv_heads, q_weight, k_weight, eps, weight_after_cast, cos, sin)  # type: ignore[union-attr]
    return True
