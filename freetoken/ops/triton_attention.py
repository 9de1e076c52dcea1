"""Paged decode attention as a Triton kernel: one query per request over its keys in the page pool.

Owns the kernel and its launch. A program takes one (request, KV head, split): the G query heads
that share the KV head (grouped-query attention), and one contiguous run of the request's key
positions. Keys are enumerated by absolute position, so the page table is read as the KV manager
hands it out (logical page i covers positions [i * P, (i + 1) * P); 0 is the NULL page) and a
sliding layer starts at its window's first position (q - k < W): the NULL entries before the
window are never read. Positions at or past the request's length are masked on load, so an
unwritten page tail never reaches the sums, whatever it holds. An 8-bit pool (int8 or
float8_e4m3, kv/tensors.py) is read in place with its per-(slot, head, block of 32) float16 scales
(`kv_scale`), dequantized in registers. Each split keeps a running max, sum and weighted V in
float32 (online softmax); the splits are combined in torch, where the attention sink (a per-head
logit that joins the denominator) is added. Logit soft-capping is applied per score.

Only decode rows (one query per request); prefill chunks are the SDPA backend's. Runs on CUDA
tensors, and on CPU tensors under Triton's interpreter (`TRITON_INTERPRET=1` before triton is
imported), which is how the tests check it without a GPU. Importing it needs triton; callers
import it only where they would run it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_N = 32  # key positions per loop iteration of one program


@triton.jit
def _decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    ks_ptr,
    vs_ptr,
    table_ptr,
    lens_ptr,
    m_ptr,
    l_ptr,
    acc_ptr,
    stride_qb,
    stride_qh,
    stride_page,
    stride_slot,
    stride_head,
    stride_table,
    n_kv,
    scale,
    softcap,
    window,
    SPLITS: tl.constexpr,
    G: tl.constexpr,
    BLOCK_G: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    P: tl.constexpr,
    BLOCK: tl.constexpr,
    NB: tl.constexpr,
    QUANT: tl.constexpr,
    SOFTCAP: tl.constexpr,
    WINDOW: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    g_ok = g < G
    d_ok = d < D
    heads = h * G + g
    q = tl.load(
        q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=g_ok[:, None] & d_ok[None, :], other=0.0
    ).to(tl.float32)  # [BLOCK_G, BLOCK_D]

    kv_len = tl.load(lens_ptr + b)
    first = kv_len * 0
    if WINDOW:
        first = tl.maximum(kv_len - window, 0)  # the query is at kv_len - 1; it sees q - k < W
    span = kv_len - first
    per_split = tl.cdiv(tl.cdiv(span, SPLITS), BLOCK) * BLOCK
    lo = first + s * per_split
    hi = tl.minimum(lo + per_split, kv_len)

    m = tl.full([BLOCK_G], -1.0e30, tl.float32)
    lsum = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    j = tl.arange(0, BLOCK)
    for start in range(lo, hi, BLOCK):
        pos = start + j
        ok = pos < hi
        page = tl.load(table_ptr + b * stride_table + pos // P, mask=ok, other=0).to(tl.int64)
        row = page * stride_page + (pos % P).to(tl.int64) * stride_slot + h * stride_head  # [BLOCK]
        mask = ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + row[:, None] + d[None, :], mask=mask, other=0.0).to(tl.float32)  # [BLOCK, BLOCK_D]
        v = tl.load(v_ptr + row[:, None] + d[None, :], mask=mask, other=0.0).to(tl.float32)
        if QUANT:  # scales [pages + 1, P, n_kv, NB] beside the pool: one per D // NB values
            srow = ((page * P + (pos % P).to(tl.int64)) * n_kv + h) * NB  # [BLOCK]
            sidx = srow[:, None] + d[None, :] // (D // NB)
            k = k * tl.load(ks_ptr + sidx, mask=mask, other=0.0).to(tl.float32)
            v = v * tl.load(vs_ptr + sidx, mask=mask, other=0.0).to(tl.float32)
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [BLOCK_G, BLOCK]
        if SOFTCAP:
            scores = softcap * (1.0 - 2.0 / (tl.exp(2.0 * scores / softcap) + 1.0))  # softcap * tanh(s / softcap)
        scores = tl.where(ok[None, :], scores, -float("inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[:, None])
        lsum = lsum * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m = m_new

    part = (b * n_kv * G + heads) * SPLITS + s  # [BLOCK_G]: row of the [B * H, SPLITS] partials
    tl.store(m_ptr + part, m, mask=g_ok)
    tl.store(l_ptr + part, lsum, mask=g_ok)
    tl.store(acc_ptr + part[:, None] * D + d[None, :], acc, mask=g_ok[:, None] & d_ok[None, :])


def splits_for(batch: int, n_kv: int, target: int = 256, most: int = 16) -> int:
    """Key-range splits per (request, KV head): enough programs to fill a GPU at small batches
    (`target` in all), at most `most`; decided from shapes only, so no host synchronisation."""
    return max(1, min(most, target // max(1, batch * n_kv)))


def paged_decode(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    page_table: torch.Tensor,
    kv_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
    splits: int | None = None,
) -> torch.Tensor:
    """q [B, H, D], one query per request at position kv_lens[b] - 1, over pool tensors
    [pages + 1, P, n_kv, D] (float, or 8-bit with `.kv_scale` [pages + 1, P, n_kv, NB]);
    page_table [B, width] int32; kv_lens [B] int64; sinks [H] or None. Returns [B, H, D] in q's dtype."""
    B, H, D = q.shape
    P, n_kv = k_pages.shape[1], k_pages.shape[2]
    G = H // n_kv
    k_scale = getattr(k_pages, "kv_scale", None)
    v_scale = getattr(v_pages, "kv_scale", None)
    quant = k_scale is not None
    if k_pages.stride() != v_pages.stride() or k_pages.stride(3) != 1 or q.stride(2) != 1:
        raise ValueError("paged_decode: K and V pools must share a layout with contiguous heads")
    if quant and (not k_scale.is_contiguous() or not v_scale.is_contiguous()):
        raise ValueError("paged_decode: the scales must be contiguous")
    n_splits = splits or splits_for(B, n_kv)
    table = page_table if page_table.stride(1) == 1 else page_table.contiguous()
    m = torch.empty(B * H, n_splits, dtype=torch.float32, device=q.device)
    lsum = torch.empty_like(m)
    acc = torch.empty(B * H, n_splits, D, dtype=torch.float32, device=q.device)
    dummy = k_pages  # an unused pointer where the pool has no scales
    _decode_kernel[(B, n_kv, n_splits)](
        q,
        k_pages,
        v_pages,
        k_scale if quant else dummy,
        v_scale if quant else dummy,
        table,
        kv_lens,
        m,
        lsum,
        acc,
        q.stride(0),
        q.stride(1),
        k_pages.stride(0),
        k_pages.stride(1),
        k_pages.stride(2),
        table.stride(0),
        n_kv,
        float(scale),
        float(softcap or 1.0),
        int(sliding_window or 0),
        SPLITS=n_splits,
        G=G,
        BLOCK_G=max(1, triton.next_power_of_2(G)),
        D=D,
        BLOCK_D=triton.next_power_of_2(D),
        P=P,
        BLOCK=BLOCK_N,
        NB=k_scale.shape[-1] if quant else 1,
        QUANT=quant,
        SOFTCAP=softcap is not None,
        WINDOW=sliding_window is not None,
    )
    return _combine(m, lsum, acc, sinks, B, H, D).to(q.dtype)


def _combine(
    m: torch.Tensor, lsum: torch.Tensor, acc: torch.Tensor, sinks: torch.Tensor | None, B: int, H: int, D: int
) -> torch.Tensor:
    """The splits' partial softmaxes ([B * H, S] max and sum, [B * H, S, D] weighted V) -> [B, H, D]
    float32, with the sink's exp(sink - max) in the denominator where there is one."""
    top = m.amax(dim=1, keepdim=True)  # [B * H, 1]
    if sinks is not None:
        sink = sinks.float().repeat(B)[:, None]  # [B * H, 1]
        top = torch.maximum(top, sink)
    w = torch.exp(m - top)  # [B * H, S]; an empty split has m = -1e30 and weighs 0
    denom = (lsum * w).sum(dim=1)
    if sinks is not None:
        denom = denom + torch.exp(sink[:, 0] - top[:, 0])
    out = (acc * w[:, :, None]).sum(dim=1) / denom[:, None]
    return out.view(B, H, D)
