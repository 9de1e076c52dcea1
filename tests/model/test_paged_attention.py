"""The plain-torch paged attention against a dense per-request reference, in float64 (exact up to
rounding), and ForwardBatch.build's slots, tables, logits rows and errors."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from freetoken.attention.metadata import ForwardBatch
from freetoken.attention.torch_backend import paged_attention

H, N_KV, D = 4, 2, 8


def dense_attention(q, k, v, q_pos, scale, window, sinks, softcap):
    """One request, no pages: q [n, H, D] at positions q_pos over k, v [L, N_KV, D] (positions 0..L-1)."""
    out = torch.empty_like(q)
    for t in range(q.shape[0]):
        for h in range(H):
            kh = h // (H // N_KV)
            logits = []
            for j in range(int(q_pos[t]) + 1):
                if window is not None and q_pos[t] - j >= window:
                    continue
                s = float(q[t, h] @ k[j, kh]) * scale
                logits.append((math.tanh(s / softcap) * softcap if softcap else s, j))
            m = max([s for s, _ in logits] + ([float(sinks[h])] if sinks is not None else []))
            weights = [(math.exp(s - m), j) for s, j in logits]
            denom = sum(w for w, _ in weights) + (math.exp(float(sinks[h]) - m) if sinks is not None else 0.0)
            out[t, h] = sum(w / denom * v[j, kh] for w, j in weights)
    return out


@pytest.mark.parametrize("page_size", [1, 3, 4])
@pytest.mark.parametrize(
    "window,sinks,softcap", [(None, False, None), (5, False, None), (5, True, None), (None, True, 2.0)]
)
@pytest.mark.parametrize("pass_window_to_build", [True, False])
def test_matches_dense_reference(page_size: int, window, sinks: bool, softcap, pass_window_to_build: bool) -> None:
    g = torch.Generator().manual_seed(0)
    rng = np.random.default_rng(0)
    P, pages_total = page_size, 64
    k_pages = torch.zeros(pages_total + 1, P, N_KV, D, dtype=torch.float64)
    v_pages = torch.zeros_like(k_pages)
    free = list(rng.permutation(np.arange(1, pages_total + 1)))
    # (cached tokens, new tokens): a decode, a prefill from scratch, a chunk after a prefix
    shapes = [(11, 1), (0, 9), (6, 7)]
    specs, ks, vs, qs = [], [], [], []
    for cached, new in shapes:
        L = cached + new
        table = np.array([free.pop() for _ in range(-(-L // P))], dtype=np.int32)
        k = torch.randn(L, N_KV, D, generator=g, dtype=torch.float64)
        v = torch.randn(L, N_KV, D, generator=g, dtype=torch.float64)
        for pos in range(L):  # all K/V written, as the model does before attending
            k_pages[table[pos // P], pos % P] = k[pos]
            v_pages[table[pos // P], pos % P] = v[pos]
        # Out-of-window pages released to NULL: never read.
        swa = table.copy()
        if window is not None:
            for i in range(len(swa)):
                if (i + 1) * P <= cached - window + 1:
                    swa[i] = 0
        specs.append((cached, new, table, swa))
        ks.append(k), vs.append(v)
        qs.append(torch.randn(new, H, D, generator=g, dtype=torch.float64))
    batch = ForwardBatch.build(specs, P, sliding_window=window if pass_window_to_build else None)
    sink_logits = torch.randn(H, generator=g, dtype=torch.float64) if sinks else None
    table = batch.swa_table if window is not None else batch.full_table
    got = paged_attention(torch.cat(qs), k_pages, v_pages, table, batch, 0.3, window, sink_logits, softcap)
    want = torch.cat(
        [
            dense_attention(q, k, v, torch.arange(c, c + n), 0.3, window, sink_logits, softcap)
            for q, k, v, (c, n) in zip(qs, ks, vs, shapes)
        ]
    )
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)


def test_unwritten_tail_is_never_read() -> None:
    """NaN in the unwritten part of a request's last page does not reach the output."""
    P = 4
    k_pages = torch.randn(3, P, N_KV, D, dtype=torch.float64)
    v_pages = torch.randn(3, P, N_KV, D, dtype=torch.float64)
    k_pages[0] = v_pages[0] = 0
    k_pages[2, 2:] = v_pages[2, 2:] = float("nan")  # tokens 6, 7 not written yet
    batch = ForwardBatch.build([(5, 1, np.array([1, 2], dtype=np.int32), None)], P)
    out = paged_attention(torch.randn(1, H, D, dtype=torch.float64), k_pages, v_pages, batch.full_table, batch, 0.5)
    assert torch.isfinite(out).all()


def test_build_slots_rows_and_padding() -> None:
    batch = ForwardBatch.build(
        [
            (5, 2, np.array([7, 3, 9], dtype=np.int32), np.array([0, 4, 8], dtype=np.int32)),
            (0, 3, np.array([2], dtype=np.int32), np.array([5], dtype=np.int32)),
        ],
        page_size=4,
        sliding_window=3,
    )
    assert batch.positions.tolist() == [5, 6, 0, 1, 2]
    assert batch.query_start.tolist() == [0, 2, 5]
    assert batch.kv_lens.tolist() == [7, 3]
    assert batch.full_table.tolist() == [[7, 3], [2, 0]]  # only the pages the tokens need, NULL-padded
    assert batch.full_slots.tolist() == [3 * 4 + 1, 3 * 4 + 2, 8, 9, 10]
    assert batch.swa_slots.tolist() == [4 * 4 + 1, 4 * 4 + 2, 20, 21, 22]
    assert batch.logits_indices.tolist() == [1, 4]
    assert batch.swa_first_page.tolist() == [0, 0]  # position 5 sees keys from 3 on: page 0
    every = ForwardBatch.build(
        [(0, 3, np.array([2]), None), (4, 1, np.array([1, 3]), None)], 4, all_logits=[True, False]
    )
    assert every.logits_indices.tolist() == [0, 1, 2, 3]
    chosen = ForwardBatch.build([(0, 3, np.array([2]), None)], 4, logits_indices=[])
    assert chosen.logits_indices.tolist() == []


@pytest.mark.parametrize(
    "spec,message",
    [
        ((4, 2, np.array([1], dtype=np.int32), None), "2 needed"),
        ((4, 2, np.array([1, 0], dtype=np.int32), None), "NULL page"),
    ],
)
def test_build_rejects_bad_tables(spec, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ForwardBatch.build([spec], page_size=4)
