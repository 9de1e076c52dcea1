"""Decode attention over a paged KV cache as one op, and a step's K/V rows written into the pools
as one: the C++ code of csrc/attention.cpp on an AVX-512 or AVX2 CPU (csrc/attention_avx2.h);
elsewhere `None` / False, and the caller takes its torch path.

Owns the choice. The kernel takes each request's key slots and their visibility as the SDPA
backend plans them (built once per step and layer kind) and reads only the visible K/V rows in
place; the torch path gathers every slot into new tensors and runs about ten ops per layer. Both
compute in float32 and round once to the query dtype; the kernel folds the scale into the query
and uses its own exp, so the two agree to float32 rounding, not bit for bit.
"""

from __future__ import annotations

import logging
from types import ModuleType

import torch

log = logging.getLogger(__name__)


def _load() -> ModuleType | None:
    try:
        from freetoken.ops import _attention_cpu  # built by `pip install -e .` (setup.py)
    except ImportError as err:
        log.info("freetoken.ops: C++ decode attention not built (%s); using torch", err)
        return None
    if not _attention_cpu.supported():
        log.info("freetoken.ops: this CPU lacks AVX-512 and AVX2; decode attention uses torch")
        return None
    return _attention_cpu


_KERNEL: ModuleType | None = _load()  # decided once at import


def kernel_available() -> bool:
    """Whether the C++ decode attention runs here (built, and an AVX-512 or AVX2 CPU)."""
    return _KERNEL is not None


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    visible: torch.Tensor,
    scale: float,
) -> torch.Tensor | None:
    """q [B, H, D] over the keys at flat pool `slots` [B, S] (int64) where `visible` [B, S]:
    [B, H, D] in q's dtype, or None when the kernel cannot take these tensors. k_cache and
    v_cache are a layer's pools [..., n_kv, D]."""
    if (
        _KERNEL is None
        or q.device.type != "cpu"
        or q.dtype not in (torch.bfloat16, torch.float32)
        or k_cache.dtype != q.dtype
        or v_cache.dtype != q.dtype
        or q.shape[-1] % 16
        or q.stride(-1) != 1
        or not (k_cache.is_contiguous() and v_cache.is_contiguous())
    ):
        return None
    return _KERNEL.decode_attention(q, k_cache, v_cache, slots, visible, scale)


def write_kv(k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """k_pool[slots] = k and v_pool[slots] = v (pools [..., n_kv, D], k and v [T, n_kv, D] of the
    pools' dtype) in one call; False (nothing written) where only the torch path can."""
    if (
        _KERNEL is None
        or k_pool.device.type != "cpu"
        or not (k.dtype == v.dtype == k_pool.dtype == v_pool.dtype)
        or k.dim() != 3
        or k.stride(-1) != 1
        or v.stride(-1) != 1
        or k.stride(1) != k.shape[2]
        or v.stride(1) != v.shape[2]
        or not (k_pool.is_contiguous() and v_pool.is_contiguous())
    ):
        return False
    _KERNEL.write_kv_(k_pool, v_pool, slots, k, v)
    return True
