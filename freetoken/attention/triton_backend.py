"""Paged attention on CUDA: decode batches through the Triton kernel, everything else through SDPA.

Owns the routing only, with `torch_backend.paged_attention`'s signature. A decode batch (one query
per request: every row of a steady decode step, and what CUDA graphs capture) goes to
`ops.triton_attention.paged_decode`, which reads the page pool in place — float or 8-bit with its
scales, full or sliding-window, with sinks and soft-capping — and does no host synchronisation.
Prefill chunks, mixed batches and float64 queries (the kernel sums in float32) go to `sdpa_backend`
(torch's fused SDPA / flash attention). It
does not write K/V and holds no state. Importing it needs triton (`attention_fn` imports it only
when it is chosen).
"""

from __future__ import annotations

import torch

from freetoken.attention import sdpa_backend
from freetoken.attention.metadata import ForwardBatch
from freetoken.ops.triton_attention import paged_decode


def paged_attention(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    page_table: torch.Tensor,
    batch: ForwardBatch,
    scale: float,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention of the batch's T query tokens over their requests' cached keys: q [T, H, D];
    k_pages, v_pages [pages + 1, P, n_kv, D]; page_table [B, max_pages] int32. Returns [T, H, D]."""
    if batch.max_query_len == 1 and q.dtype != torch.float64:  # the kernel sums in float32
        return paged_decode(q, k_pages, v_pages, page_table, batch.kv_lens, scale, sliding_window, sinks, softcap)
    return sdpa_backend.paged_attention(q, k_pages, v_pages, page_table, batch, scale, sliding_window, sinks, softcap)
