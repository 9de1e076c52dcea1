"""The SDPA paged-attention backend against the plain-torch reference in float64 (randomized
batches: page sizes, windows, GQA, mixed prefill/decode, NULL out-of-window pages), its fallback
for sinks and soft-capping, and the backend choice."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from freetoken.attention import attention_fn, sdpa_backend, torch_backend, triton_fn
from freetoken.attention.metadata import ForwardBatch
from freetoken.errors import ConfigError

D = 8


def _case(seed: int, P: int, n_heads: int, n_kv: int, window: int | None, shapes, pass_window: bool, D: int = D):
    """Random pools, tables and queries for requests of (cached, new) tokens; tails of last pages are NaN."""
    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    pages_total = 200
    k_pages = torch.randn(pages_total + 1, P, n_kv, D, generator=g, dtype=torch.float64)
    v_pages = torch.randn(pages_total + 1, P, n_kv, D, generator=g, dtype=torch.float64)
    k_pages[0] = v_pages[0] = 0  # the NULL page stays zeros, as the KV pool keeps it
    free = list(rng.permutation(np.arange(1, pages_total + 1)))
    specs = []
    for cached, new in shapes:
        L = cached + new
        table = np.array([free.pop() for _ in range(-(-L // P))], dtype=np.int32)
        if L % P:  # not written yet: must never reach the output
            k_pages[table[-1], L % P :] = float("nan")
            v_pages[table[-1], L % P :] = float("nan")
        swa = table.copy()
        if window is not None:
            for i in range(len(swa)):
                if (i + 1) * P <= cached - window + 1:
                    swa[i] = 0  # every key of the page is out of the window: released
        specs.append((cached, new, table, swa if window is not None else None))
    batch = ForwardBatch.build(specs, P, sliding_window=window if pass_window else None)
    T = sum(n for _, n in shapes)
    q = torch.randn(T, n_heads, D, generator=g, dtype=torch.float64)
    table = batch.swa_table if window is not None else batch.full_table
    return q, k_pages, v_pages, table, batch


SHAPES = [
    [(11, 1)],  # one decode
    [(0, 9)],  # one prefill from scratch
    [(11, 1), (0, 9), (6, 7)],  # decode, prefill, chunk after a prefix
    [(3, 1), (20, 1), (0, 1)],  # decodes only
    [(17, 5), (40, 2)],
]


@pytest.mark.parametrize("page_size", [1, 3, 4, 16])
@pytest.mark.parametrize("window", [None, 1, 5])
@pytest.mark.parametrize("heads", [(4, 2), (6, 2), (2, 2), (4, 1)])
@pytest.mark.parametrize("pass_window", [True, False])
def test_matches_reference(page_size: int, window: int | None, heads, pass_window: bool) -> None:
    n_heads, n_kv = heads
    for i, shapes in enumerate(SHAPES):
        q, k_pages, v_pages, table, batch = _case(i, page_size, n_heads, n_kv, window, shapes, pass_window)
        got = sdpa_backend.paged_attention(q, k_pages, v_pages, table, batch, 0.3, window)
        want = torch_backend.paged_attention(q, k_pages, v_pages, table, batch, 0.3, window)
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("sinks,softcap", [(True, None), (False, 2.0), (True, 2.0)])
def test_sinks_and_softcap_fall_back_to_reference(sinks: bool, softcap: float | None) -> None:
    q, k_pages, v_pages, table, batch = _case(7, 4, 4, 2, 5, SHAPES[2], True)
    sink_logits = torch.randn(4, dtype=torch.float64) if sinks else None
    got = sdpa_backend.paged_attention(q, k_pages, v_pages, table, batch, 0.3, 5, sink_logits, softcap)
    want = torch_backend.paged_attention(q, k_pages, v_pages, table, batch, 0.3, 5, sink_logits, softcap)
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision_close_to_reference(dtype: torch.dtype) -> None:
    q, k_pages, v_pages, table, batch = _case(3, 4, 4, 2, None, SHAPES[2], True)
    q, k_pages, v_pages = (t.to(dtype) for t in (q, k_pages, v_pages))
    got = sdpa_backend.paged_attention(q, k_pages, v_pages, table, batch, 0.3)
    want = torch_backend.paged_attention(q, k_pages, v_pages, table, batch, 0.3)
    assert got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_backend_choice() -> None:
    assert attention_fn("cpu") is sdpa_backend.paged_attention
    # CUDA: the Triton decode backend where triton imports, SDPA otherwise
    assert attention_fn(torch.device("cuda", 0)) is (triton_fn() or sdpa_backend.paged_attention)
    assert attention_fn("cuda", "sdpa") is sdpa_backend.paged_attention
    assert attention_fn("meta") is torch_backend.paged_attention
    assert attention_fn("cpu", "torch") is torch_backend.paged_attention
    assert attention_fn("meta", "sdpa") is sdpa_backend.paged_attention
    with pytest.raises(ConfigError, match="unknown attention backend"):
        attention_fn("cpu", "flash")


@pytest.mark.parametrize("window", [None, 100])
@pytest.mark.parametrize("shapes", [[(0, 600)], [(300, 700)], [(37, 513)]])
def test_long_chunks_attend_block_by_block(window: int | None, shapes) -> None:
    """A single request's long chunk goes block by block over only the keys each block sees,
    with the reference's result; on a sliding layer the blocks read far fewer keys than the chunk's."""
    q, k_pages, v_pages, table, batch = _case(11, 16, 4, 1, window, shapes, True)
    assert batch.max_query_len >= 2 * sdpa_backend.QUERY_BLOCK
    got = sdpa_backend.paged_attention(q, k_pages, v_pages, table, batch, 0.3, window)
    want = torch_backend.paged_attention(q, k_pages, v_pages, table, batch, 0.3, window)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)
    (blocks,) = [v for k, v in batch.memo.items() if k[-1] == "blocks"]
    read = sum((q1 - q0) * (k1 - k0) for q0, q1, k0, k1 in blocks)
    S = batch.memo[next(k for k in batch.memo if k[-1] != "blocks")][2]
    assert read < batch.max_query_len * S * (0.6 if window else 0.8)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 100])
def test_mixed_batches_split_by_kind(dtype: torch.dtype, window: int | None) -> None:
    """Decode rows beside short and long prefill chunks: the decode rows together (the decode op in
    float32 / bfloat16), each chunk on its own keys, as the reference computes the whole batch."""
    shapes = [(11, 1), (0, 600), (6, 7), (300, 1), (40, 30)]
    q, k_pages, v_pages, table, batch = _case(
        13, 16, 4, 2, window, shapes, True, D=16
    )  # the decode op takes D % 16 == 0
    q, k_pages, v_pages = (t.to(dtype) for t in (q, k_pages, v_pages))
    got = sdpa_backend.paged_attention(q, k_pages, v_pages, table, batch, 0.3, window)
    want = torch_backend.paged_attention(q, k_pages, v_pages, table, batch, 0.3, window)
    assert got.dtype == dtype and torch.isfinite(got).all()
    tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 3e-2}[dtype]
    torch.testing.assert_close(got.double(), want.double(), atol=tol, rtol=tol)
