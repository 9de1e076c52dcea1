"""Paged attention through torch's fused scaled_dot_product_attention (the default backend).

Owns the same computation as `torch_backend.paged_attention` (causal, sliding window, GQA) with
the same signature, but hands the softmax(q k^T) v to `F.scaled_dot_product_attention` with a
boolean mask built from absolute positions, and gathers only what can be visible: per request the
key slots of the table columns the batch needs (the window's columns on sliding layers). Keys at
or past a request's length read slot 0 of the NULL page and NULL table entries point into it; the
KV pool keeps that page all zeros, so stale or unwritten slots never reach the fused kernel.
Grouped-query attention uses SDPA's `enable_gqa`, so K/V are never copied per query head. Cases
SDPA cannot do exactly (attention sinks, logit soft-capping) go to the reference; a decode batch
(one query per request) takes `ops.decode_attention` (one C++ call reading only the visible K/V
rows) where it runs, else two plain matmuls instead of the fused kernel. A mixed batch sends its
decode rows there together and each prefill chunk alone (no padding to the longest chunk); a
long chunk is attended in blocks of QUERY_BLOCK queries over only the keys each block sees. A
single request's chunk goes through `chunk.attend_chunk` (SDPA, or in bfloat16 on a CPU three
GEMMs that are faster than SDPA there). The slots and
the mask depend only on the batch and the layer kind, so they are built once per step and kept in
the batch's memo. An 8-bit or narrower cache is dequantized row by row as it is gathered
(`kv_read.py`; the fused decode op reads only a cache in the query's dtype). It does not write
K/V and holds no state of its own.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from freetoken.attention import torch_backend
from freetoken.attention.chunk import attend_chunk
from freetoken.attention.kv_read import take_rows
from freetoken.attention.metadata import ForwardBatch
from freetoken.ops.attention import decode_attention


def _key_slots(
    page_table: torch.Tensor, batch: ForwardBatch, sliding_window: int | None, P: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pool slot [B, S] of each gathered key and the key positions ([B, S] or [1, S]).

    Slots at or past a request's length become 0 (the NULL page): a page's unwritten tail never
    reaches the kernel. NULL table entries already point into the NULL page.
    """
    B, width = page_table.shape
    device = page_table.device
    offsets = torch.arange(P, device=device)
    if sliding_window is not None and batch.swa_first_page is not None and batch.sliding_window == sliding_window:
        cols = batch.swa_first_page[:, None] + torch.arange(batch.swa_num_pages, device=device)  # [B, C]
        # Columns past the table are past every request's length: any page works, the slot is zeroed.
        pages = page_table.long().gather(1, cols.clamp(max=width - 1))  # [B, C]
        k_pos = (cols[:, :, None] * P + offsets).flatten(1)  # [B, S]
    else:
        pages = page_table.long()  # [B, C = width]
        k_pos = torch.arange(width * P, device=device)[None, :]  # [1, S]
    slots = (pages[:, :, None] * P + offsets).flatten(1)  # [B, S]
    return slots * (k_pos < batch.kv_lens[:, None]), k_pos


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

    q [T, H, D]; k_pages, v_pages [pages + 1, P, n_kv_heads, D] (page 0 all zeros);
    page_table [B, max_pages] int32; sinks [H] or None. Returns [T, H, D] in q's dtype.
    """
    if sinks is not None or softcap is not None:
        return torch_backend.paged_attention(
            q, k_pages, v_pages, page_table, batch, scale, sliding_window, sinks, softcap
        )
    key = ("sdpa", sliding_window, page_table is batch.swa_table)
    plan = batch.memo.get(key)
    if plan is None:  # the same for every layer of this kind in this step: built once
        plan = batch.memo[key] = _plan(page_table, batch, sliding_window, k_pages.shape[1], q.device)
    flat, visible, S, decode_keys = plan
    # A decode batch: the fused op reads the visible rows in place.
    if decode_keys is not None and k_pages.dtype == q.dtype:
        out = decode_attention(q, k_pages, v_pages, *decode_keys, scale)
        if out is not None:
            return out
    T, H, D = q.shape
    n_kv = k_pages.shape[2]
    B, Lq = batch.num_requests, batch.max_query_len
    if 1 < Lq <= batch.alone_max:  # every chunk short enough to attend query by query, as decode rows
        keys = _memo_alone(
            key + ("alone",), flat.view(B, S), visible, batch.token_request, batch.token_offset, batch.memo
        )
        out = _alone(q, k_pages, v_pages, keys, scale)
        if out is not None:
            return out
    k = take_rows(k_pages, flat, q.dtype).view(B, S, n_kv, D).transpose(1, 2)  # [B, n_kv, S, D], dequantized
    v = take_rows(v_pages, flat, q.dtype).view(B, S, n_kv, D).transpose(1, 2)  # [B, n_kv, S, D]

    if Lq == 1:  # a decode batch: one query per request
        return _decode(q, k, v, visible, scale)
    unpadded = T == B * Lq  # every request has Lq new tokens (all decodes, or one prefill)
    if B == 1 and Lq >= 2 * QUERY_BLOCK:  # one long prefill chunk: attend block by block
        blocks = _memo_blocks(key + ("blocks",), visible, batch.memo)
        return _blocked(q.view(1, Lq, H, D).transpose(1, 2), k, v, visible, blocks, scale).view(T, H, D)
    if not unpadded:  # decode rows beside prefill chunks: padding every request to Lq would waste most of it
        split = batch.memo.get(("split",))
        if split is None:
            split = batch.memo[("split",)] = _Split.of(batch)
        return _mixed(
            q, k, v, k_pages, v_pages, flat.view(B, S), visible, split, scale, key, batch.memo, batch.alone_max
        )
    if B == 1:  # one prefill chunk
        return attend_chunk(q.view(1, Lq, H, D).transpose(1, 2), k, v, visible, scale).transpose(1, 2).reshape(T, H, D)
    out = F.scaled_dot_product_attention(
        q.view(B, Lq, H, D).transpose(1, 2), k, v, attn_mask=visible, scale=scale, enable_gqa=H > n_kv
    )  # [B, H, Lq, D]
    return out.transpose(1, 2).reshape(T, H, D)


class _Split:
    """A mixed batch's requests by kind: decode rows (one query) and prefill chunks."""

    def __init__(self, starts: list[int], decode: list[int], chunks: list[int]) -> None:
        self.starts, self.decode, self.chunks = starts, decode, chunks
        self.decode_idx = torch.tensor(decode, dtype=torch.long)
        self.decode_tok = torch.tensor([starts[b] for b in decode], dtype=torch.long)

    @staticmethod
    def of(batch: ForwardBatch) -> _Split:
        starts = batch.query_start.tolist()
        lens = [starts[b + 1] - starts[b] for b in range(batch.num_requests)]
        return _Split(starts, [b for b, n in enumerate(lens) if n == 1], [b for b, n in enumerate(lens) if n > 1])


def _mixed(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    slots: torch.Tensor,
    visible: torch.Tensor,
    split: _Split,
    scale: float,
    key: tuple,
    memo: dict,
    alone_max: int,
) -> torch.Tensor:
    """q [T, H, D]; k, v [B, n_kv, S, D] gathered; slots [B, S]; visible [B, 1, Lq, S] -> [T, H, D].
    The decode rows go to the decode op (or the matmuls) together, a chunk of at most `alone_max`
    rows to the decode op query by query (`_alone`), each other chunk to SDPA on its own rows and
    keys (block by block when long)."""
    T, H, D = q.shape
    out = q.new_empty(T, H, D)
    device = q.device
    if split.decode:
        rows = memo.get(key + ("decode",))
        if rows is None:  # the decode rows' tokens, slots and mask: the same for every layer of this kind
            idx, tok = split.decode_idx.to(device), split.decode_tok.to(device)
            rows = memo[key + ("decode",)] = (
                idx,
                tok,
                slots.index_select(0, idx),
                visible[:, 0, 0].index_select(0, idx),
            )
        idx, tok, slots_d, visible_d = rows  # type: ignore[misc]
        qd = q.index_select(0, tok)  # [Bd, H, D]
        od = decode_attention(qd, k_pages, v_pages, slots_d, visible_d, scale)
        if od is None:
            od = _decode(
                qd, k.index_select(0, idx), v.index_select(0, idx), visible.index_select(0, idx)[:, :, :1], scale
            )
        out.index_copy_(0, tok, od)
    for b in split.chunks:
        s, e = split.starts[b], split.starts[b + 1]
        L = e - s
        if L <= alone_max:
            rows = torch.arange(L, device=device)
            keys = _memo_alone(key + ("alone", b), slots, visible, torch.full_like(rows, b), rows, memo)
            ob = _alone(q[s:e], k_pages, v_pages, keys, scale)
            if ob is not None:
                out[s:e] = ob
                continue
        qb = q[s:e].view(1, L, H, D).transpose(1, 2)  # [1, H, L, D]
        vis = visible[b : b + 1, :, :L]  # [1, 1, L, S]
        if L >= 2 * QUERY_BLOCK:
            blocks = _memo_blocks(key + ("blocks", b), vis, memo)
            out[s:e] = _blocked(qb, k[b : b + 1], v[b : b + 1], vis, blocks, scale)[0]
        else:
            out[s:e] = attend_chunk(qb, k[b : b + 1], v[b : b + 1], vis, scale)[0].transpose(0, 1)
    return out


# Query rows per call of the decode op when a chunk is attended query by query: bounds the
# [rows, S] copies of slots and mask each call takes.
ALONE_ROWS = 64


def _memo_alone(
    key: tuple, slots: torch.Tensor, visible: torch.Tensor, request: torch.Tensor, offset: torch.Tensor, memo: dict
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The slots and mask ([rows, S] each) of every ALONE_ROWS query rows as the decode op takes
    them, from the rows' request index and offset ([R] each), slots [B, S] and visible [B, 1, Lq, S]:
    the same for every layer of a kind, so made once per step."""
    keys = memo.get(key)
    if keys is None:
        keys = memo[key] = [
            (
                slots.index_select(0, request[r0 : r0 + ALONE_ROWS]),
                visible[request[r0 : r0 + ALONE_ROWS], 0, offset[r0 : r0 + ALONE_ROWS]].contiguous(),
            )
            for r0 in range(0, request.shape[0], ALONE_ROWS)
        ]
    return keys  # type: ignore[return-value]


def _alone(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    keys: list[tuple[torch.Tensor, torch.Tensor]],
    scale: float,
) -> torch.Tensor | None:
    """Each query row of q [R, H, D] attended alone by the decode op over its keys (`_memo_alone`)
    -> [R, H, D]; None where the op cannot run (the caller takes its other path).

    A row's result is then the one a decode step computes for it: the op's sums run over the
    visible keys in position order, in float32 lanes fixed by the key's index modulo 16 (a page
    of 16 slots or a multiple keeps that index's residue the position's), so no other row, the
    chunk it came in and the keys it does not see change a bit of it."""
    if q.device.type != "cpu" or k_pages.dtype != q.dtype:
        return None
    out = q.new_empty(q.shape)
    for i, (slots, visible) in enumerate(keys):
        r0 = i * ALONE_ROWS
        got = decode_attention(q[r0 : r0 + ALONE_ROWS], k_pages, v_pages, slots, visible, scale)
        if got is None:
            return None
        out[r0 : r0 + ALONE_ROWS] = got
    return out


# Queries per block of a long single-request chunk: each block reads only the keys its rows can see
# (the window's on sliding layers, up to its last row on causal ones), so a chunk costs about
# half of one masked call over all the chunk's keys; 256 keeps each call large enough to be efficient.
QUERY_BLOCK = 256


def _query_blocks(visible: torch.Tensor) -> list[tuple[int, int, int, int]]:
    """(q0, q1, k0, k1) per block of QUERY_BLOCK query rows of visible [1, 1, Lq, S]: the key
    columns [k0, k1) hold every key those rows see (each row's keys are one contiguous run)."""
    rows = visible[0, 0]  # [Lq, S]
    Lq, S = rows.shape
    blocks = []
    for q0 in range(0, Lq, QUERY_BLOCK):
        q1 = min(q0 + QUERY_BLOCK, Lq)
        cols = rows[q0:q1].any(dim=0).nonzero()
        k0, k1 = (int(cols[0]), int(cols[-1]) + 1) if cols.numel() else (0, S)
        blocks.append((q0, q1, k0, k1))
    return blocks


def _memo_blocks(key: tuple, visible: torch.Tensor, memo: dict) -> list[tuple[int, int, int, int]]:
    """`_query_blocks(visible)`, made once per step for every layer of a kind."""
    blocks = memo.get(key)
    if blocks is None:
        blocks = memo[key] = _query_blocks(visible)
    return blocks  # type: ignore[return-value]


def _blocked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    visible: torch.Tensor,
    blocks: list[tuple[int, int, int, int]],
    scale: float,
) -> torch.Tensor:
    """q [1, H, Lq, D], k and v [1, n_kv, S, D], visible [1, 1, Lq, S] -> [1, Lq, H, D], one attention
    call per block over its key columns only."""
    out = q.new_empty(1, q.shape[2], q.shape[1], q.shape[3])  # [1, Lq, H, D]
    for q0, q1, k0, k1 in blocks:
        out[:, q0:q1] = attend_chunk(
            q[:, :, q0:q1], k[:, :, k0:k1], v[:, :, k0:k1], visible[:, :, q0:q1, k0:k1], scale
        ).transpose(1, 2)
    return out


def _decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, scale: float) -> torch.Tensor:
    """One query per request, by plain matmuls in at least float32: q [B, H, D], k and v
    [B, n_kv, S, D], visible [B, 1, 1, S] -> [B, H, D]. torch's fused CPU kernel costs 5-10x more
    per call at this shape (setup and tiling for long query blocks)."""
    B, H, D = q.shape
    n_kv = k.shape[1]
    G = H // n_kv
    dtype = torch.promote_types(q.dtype, torch.float32)
    qg = q.view(B, n_kv, G, D).to(dtype)  # [B, n_kv, G, D]: the query heads of each kv head
    # One query head per matmul, every operand contiguous: a GEMM's values depend on its row count
    # and on its operands' layout (a gathered [B, S, n_kv, D] cache seen as [B, n_kv, S, D] is
    # strided unless n_kv is 1), and a tensor-parallel rank holds fewer query and KV heads than one
    # rank does, so each head must be computed alike whatever G and n_kv are (the decode kernel's
    # activation rounding would amplify any difference).
    kt = k.to(dtype).contiguous().transpose(-1, -2)  # [B, n_kv, D, S]
    vf = v.to(dtype).contiguous()  # [B, n_kv, S, D]
    heads = [qg[:, :, g : g + 1].contiguous() for g in range(G)]
    scores = torch.cat([torch.matmul(h, kt) for h in heads], dim=2).mul_(scale)  # [B, n_kv, G, S]
    probs = scores.masked_fill_(~visible, float("-inf")).softmax(dim=-1)
    out = torch.cat([torch.matmul(probs[:, :, g : g + 1].contiguous(), vf) for g in range(G)], dim=2)  # [B, n_kv, G, D]
    return out.to(q.dtype).view(B, H, D)  # [B, H, D]


_Plan = tuple[torch.Tensor, torch.Tensor, int, "tuple[torch.Tensor, torch.Tensor] | None"]


def _plan(
    page_table: torch.Tensor, batch: ForwardBatch, sliding_window: int | None, P: int, device: torch.device
) -> _Plan:
    """What every layer of one kind gathers and masks: pool slots [B * S], mask [B, 1, Lq, S], S,
    and for a decode batch (Lq = 1) the slots and mask as `decode_attention` takes them, [B, S]
    each (views made once here rather than per layer)."""
    B, Lq, T = batch.num_requests, batch.max_query_len, batch.num_tokens
    slots, k_pos = _key_slots(page_table, batch, sliding_window, P)  # [B, S], [B or 1, S]
    unpadded = T == B * Lq
    if unpadded:
        q_pos = batch.positions.view(B, Lq)  # [B, Lq]
    else:
        q_pos = torch.full((B, Lq), -1, dtype=torch.long, device=device)  # [B, Lq], -1 = padding
        q_pos[batch.token_request, batch.token_offset] = batch.positions
    # q - k >= 0 also keeps keys at or past the request's length out (queries lie below it).
    diff = q_pos[:, :, None] - k_pos[:, None, :]  # [B, Lq, S]
    visible = diff >= 0
    if sliding_window is not None:
        visible &= diff < sliding_window
    if not unpadded:  # a padded row would see nothing (SDPA gives NaN): let it see all; it is dropped
        visible |= (q_pos < 0)[:, :, None]
    S = slots.shape[1]
    decode_keys = (slots.view(B, S), visible.view(B, S)) if Lq == 1 else None
    return slots.reshape(-1), visible[:, None], S, decode_keys
