"""Reading K/V out of the page pool for attention, dequantizing an 8-bit cache on the way.

Owns the one place where attention turns stored K/V into compute-dtype tensors. A pool tensor
`[pages + 1, P, n_kv, D]` is either in a float dtype (read as is, cast to the query's dtype when
the cache is stored narrower, e.g. bf16 under a float32 model) or 8-bit (int8 / float8_e4m3)
with scales attached as `pages.kv_scale` `[pages + 1, P, n_kv, G]` by `kv/tensors.py`, one per
block of D / G values: value = stored * scale (`kv.tensors.dequantize`, beside the quantization on
write). Only the gathered rows are dequantized, never the pool.
"""

from __future__ import annotations

import torch

from freetoken.kv.tensors import dequantize


def scale_of(pages: torch.Tensor) -> torch.Tensor | None:
    """The per-(slot, head) scale of an 8-bit pool tensor; None for a float one."""
    return getattr(pages, "kv_scale", None)


def take_pages(pages: torch.Tensor, idx: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`pages[idx]` in `dtype`: idx [B, C] -> [B, C, P, n_kv, D]."""
    out = pages[idx]
    scale = scale_of(pages)
    if scale is not None:
        return dequantize(out, scale[idx], dtype)
    return out if out.dtype == dtype else out.to(dtype)


def take_rows(pages: torch.Tensor, flat: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Slots `flat` [N] of the pool (slot = page * P + offset) in `dtype` -> [N, n_kv, D]."""
    n_kv, d = pages.shape[2], pages.shape[3]
    out = pages.view(-1, n_kv, d).index_select(0, flat)
    scale = scale_of(pages)
    if scale is not None:
        return dequantize(out, scale.view(-1, *scale.shape[2:]).index_select(0, flat), dtype)
    return out if out.dtype == dtype else out.to(dtype)
