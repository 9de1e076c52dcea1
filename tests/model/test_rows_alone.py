"""A chunk attended query by query (`ForwardBatch.alone_max`) gives each row exactly the bits a
decode step gives it: alone or beside other requests, in a chunk of any length, on full and
sliding layers. This is what makes a verified draft compute as its decode would, and what
`--deterministic` builds on. The negative control shows the other path (SDPA on the chunk) does
differ, so the equality is the query-by-query path's doing."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from freetoken.attention import sdpa_backend
from freetoken.attention.metadata import ForwardBatch

P, H, N_KV, D = 16, 8, 2, 64


def _pools(seed: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(65, P, N_KV, D, generator=g).to(dtype)
    v = torch.randn(65, P, N_KV, D, generator=g).to(dtype)
    k[0] = v[0] = 0  # the NULL page
    return k, v


def _attend(specs, q, k, v, window, alone_max):  # type: ignore[no-untyped-def]
    batch = ForwardBatch.build(specs, P, sliding_window=window, alone_max=alone_max)
    table = batch.swa_table if window is not None else batch.full_table
    return sdpa_backend.paged_attention(q, k, v, table, batch, 0.125, window)


def _table(pages: list[int], window: int | None):  # type: ignore[no-untyped-def]
    t = np.array(pages, dtype=np.int32)
    return (t, t.copy() if window is not None else None)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("window", [None, 40])
@pytest.mark.parametrize("beside", [False, True])
def test_a_chunk_attended_alone_equals_its_decode_rows(dtype: torch.dtype, window: int | None, beside: bool) -> None:
    k, v = _pools(1, dtype)
    cached, new = 70, 9
    full, swa = _table(list(range(1, 7)), window)  # 6 pages: 96 slots for 79 tokens
    g = torch.Generator().manual_seed(2)
    q = torch.randn(new, H, D, generator=g).to(dtype)
    specs = [(cached, new, full, swa)]
    qs = q
    if beside:  # a long prefill chunk and a decode row of other requests in the same step
        other_full, other_swa = _table(list(range(10, 20)), window)
        dec_full, dec_swa = _table(list(range(30, 34)), window)
        specs = [(0, 150, other_full, other_swa), (cached, new, full, swa), (50, 1, dec_full, dec_swa)]
        qs = torch.cat([torch.randn(150, H, D, generator=g).to(dtype), q, torch.randn(1, H, D, generator=g).to(dtype)])
    got = _attend(specs, qs, k, v, window, alone_max=new)
    got = got[150 : 150 + new] if beside else got
    for i in range(new):  # row i as the decode step at position cached + i computes it
        want = _attend([(cached + i, 1, full, swa)], q[i : i + 1], k, v, window, alone_max=1)
        assert torch.equal(got[i], want[0]), f"row {i}"


def test_without_it_a_chunk_rounds_otherwise() -> None:
    """The control: the same bf16 chunk through SDPA differs from the decode rows somewhere."""
    k, v = _pools(1, torch.bfloat16)
    full, _ = _table(list(range(1, 7)), None)
    q = torch.randn(9, H, D, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    got = _attend([(70, 9, full, None)], q, k, v, None, alone_max=1)
    rows = torch.cat([_attend([(70 + i, 1, full, None)], q[i : i + 1], k, v, None, alone_max=1) for i in range(9)])
    assert not torch.equal(got, rows)
