"""Paged attention in plain torch: the numerical reference for every faster backend.

Owns computing softmax(q k^T) v for a batch of requests whose keys and values live in pages:
causal, sliding window, attention sinks (a learned per-head logit that joins the softmax
denominator), logit soft-capping and grouped-query attention, over a float or 8-bit cache
(`kv_read.py` dequantizes the gathered pages). Batched over requests: the table
columns are gathered into a padded [B, S, n_kv_heads, D] and masked by absolute position
(key position = column * P + offset; valid iff k <= q, and q - k < W on sliding layers), so NULL
entries, unwritten page tails and out-of-window keys never contribute. It does not write K/V
(the caller stores the step's K/V before calling) and holds no state.
"""

from __future__ import annotations

import torch

from freetoken.attention.kv_read import take_pages
from freetoken.attention.metadata import ForwardBatch

_LOW_PRECISION = (torch.float16, torch.bfloat16)


def _columns(page_table: torch.Tensor, batch: ForwardBatch, sliding_window: int | None) -> torch.Tensor:
    """Logical page index of each gathered column [B, C] (may run past the table; masked later)."""
    b, width = page_table.shape
    device = page_table.device
    if sliding_window is not None and batch.swa_first_page is not None and batch.sliding_window == sliding_window:
        span = torch.arange(batch.swa_num_pages, device=device)
        return batch.swa_first_page[:, None] + span[None, :]  # [B, C]
    return torch.arange(width, device=device)[None, :].expand(b, width)  # [B, C]


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
    """Attention of the batch's T query tokens over their requests' cached keys.

    q [T, H, D]; k_pages, v_pages [pages + 1, P, n_kv_heads, D]; page_table [B, max_pages] int32;
    sinks [H] or None. Returns [T, H, D] in q's dtype.
    """
    T, H, D = q.shape
    P, n_kv = k_pages.shape[1], k_pages.shape[2]
    G = H // n_kv
    B, width = page_table.shape
    Lq = batch.max_query_len
    device = q.device

    cols = _columns(page_table, batch, sliding_window)  # [B, C]
    C = cols.shape[1]
    in_table = cols < width
    pages = page_table.long().gather(1, cols.clamp(max=width - 1))  # [B, C]
    pages = torch.where(in_table, pages, torch.zeros_like(pages))
    k = take_pages(k_pages, pages, q.dtype).view(B, C * P, n_kv, D)  # [B, S, n_kv, D], dequantized
    v = take_pages(v_pages, pages, q.dtype).view(B, C * P, n_kv, D)  # [B, S, n_kv, D]
    k_pos = (cols[:, :, None] * P + torch.arange(P, device=device)).view(B, C * P)  # [B, S]

    # Keys past a request's length are stale or unwritten: zero V there so that even non-finite
    # garbage cannot reach the output through a zero probability.
    k_live = (k_pos < batch.kv_lens[:, None]) & in_table.repeat_interleave(P, dim=1)  # [B, S]
    v = v.masked_fill(~k_live[:, :, None, None], 0)

    q_pos = torch.full((B, Lq), -1, dtype=torch.long, device=device)  # [B, Lq], -1 = padding
    q_pos[batch.token_request, batch.token_offset] = batch.positions
    q_pad = q.new_zeros(B, Lq, n_kv, G, D)  # [B, Lq, n_kv, G, D]
    q_pad[batch.token_request, batch.token_offset] = q.view(T, n_kv, G, D)

    diff = q_pos[:, :, None] - k_pos[:, None, :]  # [B, Lq, S], q - k
    visible = (diff >= 0) & k_live[:, None, :] & (q_pos[:, :, None] >= 0)
    if sliding_window is not None:
        visible &= diff < sliding_window

    scores = torch.einsum("bqhgd,bshd->bhgqs", q_pad, k) * scale  # [B, n_kv, G, Lq, S]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if scores.dtype in _LOW_PRECISION:
        scores = scores.float()
    scores = scores.masked_fill(~visible[:, None, None, :, :], torch.finfo(scores.dtype).min)
    if sinks is not None:
        sink = sinks.to(scores.dtype).view(1, n_kv, G, 1, 1).expand(B, n_kv, G, Lq, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]  # drop the sink
    else:
        probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("bhgqs,bshd->bqhgd", probs.to(v.dtype), v)  # [B, Lq, n_kv, G, D]
    return out[batch.token_request, batch.token_offset].reshape(T, H, D)  # [T, H, D]
