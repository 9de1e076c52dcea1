"""attend_chunk: in bfloat16 on a CPU with a bfloat16 unit (the centered-score matmul path) it
stays within twice the fused SDPA kernel's error against float64, with GQA and sliding-window masks
at the sizes real models prefill; in float32, and in bfloat16 on a CPU without one, it is SDPA.
The matmul path's tests force it (`matmul_path`) so they run on either kind of CPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from freetoken.attention import chunk
from freetoken.attention.chunk import attend_chunk


@pytest.fixture
def matmul_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bfloat16 matmul path whatever this CPU has (its results do not depend on it; only its speed)."""
    monkeypatch.setattr(chunk, "_FAST_BF16", True)


def _case(H: int, n_kv: int, L: int, S: int, D: int, window: int | None, seed: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, H, L, D, generator=g, dtype=torch.float64) * 1.5  # score spread as in real layers
    k = torch.randn(1, n_kv, S, D, generator=g, dtype=torch.float64)
    v = torch.randn(1, n_kv, S, D, generator=g, dtype=torch.float64)
    pos = torch.arange(L)[:, None] + (S - L)  # the chunk's queries are the last L positions
    key = torch.arange(S)[None, :]
    visible = key <= pos
    if window is not None:
        visible &= key > pos - window
    return q, k, v, visible[None, None]


def _reference(q, k, v, visible, scale):  # float64, heads expanded
    g = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(
        q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), attn_mask=visible, scale=scale
    )


@pytest.mark.parametrize(
    ("H", "n_kv", "L", "S", "D", "window"),
    [
        (4, 1, 256, 512, 256, None),  # Gemma 3 270M's heads, a second block of a long chunk
        (4, 1, 256, 768, 256, 512),  # a sliding layer
        (9, 3, 100, 140, 64, None),  # SmolLM2's heads after a cached prefix
        (8, 8, 80, 80, 32, 8),
    ],
)
def test_bfloat16_error_within_twice_the_fused_kernels(
    H: int, n_kv: int, L: int, S: int, D: int, window: int | None, matmul_path: None
) -> None:
    q, k, v, visible = _case(H, n_kv, L, S, D, window, seed=H * L + S)
    scale = D**-0.5
    want = _reference(q, k, v, visible, scale)
    qb, kb, vb = (t.bfloat16() for t in (q, k, v))
    got = attend_chunk(qb, kb, vb, visible, scale)
    fused = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=visible, scale=scale, enable_gqa=H > n_kv)
    assert got.dtype == torch.bfloat16 and got.shape == (1, H, L, D)
    err = (got.double() - want).abs().max().item()
    fused_err = (fused.double() - want).abs().max().item()
    assert err <= 2 * fused_err, (err, fused_err)


@pytest.mark.parametrize(
    ("dtype", "L", "fast_bf16"), [(torch.float32, 100, True), (torch.bfloat16, 20, True), (torch.bfloat16, 100, False)]
)
def test_float32_short_chunks_and_emulated_bfloat16_are_the_fused_kernel(
    dtype: torch.dtype, L: int, fast_bf16: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(chunk, "_FAST_BF16", fast_bf16)  # without a bfloat16 unit, bfloat16 GEMMs are emulated
    q, k, v, visible = _case(4, 2, L, L + 10, 16, None, seed=1)
    q, k, v = (t.to(dtype) for t in (q, k, v))
    got = attend_chunk(q, k, v, visible, 0.25)
    assert torch.equal(got, F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=0.25, enable_gqa=True))


def test_gemm_shapes_are_bucketed(monkeypatch: pytest.MonkeyPatch, matmul_path: None) -> None:
    """oneDNN keeps memory per GEMM shape it has seen: free chunk and key lengths reach only a few
    shapes (queries padded to QUERY_BUCKET, keys to KEY_BUCKET, SDPA past MAX_KEYS)."""
    seen: set[tuple[tuple[int, ...], ...]] = set()
    real_bmm, real_baddbmm = torch.bmm, torch.baddbmm

    def bmm(a, b):  # type: ignore[no-untyped-def]
        seen.add((tuple(a.shape), tuple(b.shape)))
        return real_bmm(a, b)

    def baddbmm(c, a, b, **kw):  # type: ignore[no-untyped-def]
        seen.add((tuple(a.shape), tuple(b.shape)))
        return real_baddbmm(c, a, b, **kw)

    monkeypatch.setattr(chunk.torch, "bmm", bmm)
    monkeypatch.setattr(chunk.torch, "baddbmm", baddbmm)
    g = torch.Generator().manual_seed(0)
    for _ in range(40):
        L = int(torch.randint(chunk.MIN_QUERIES, 2 * 256, (), generator=g))
        S = L + int(torch.randint(0, chunk.MAX_KEYS - L + 1, (), generator=g)) if L < chunk.MAX_KEYS else L
        q, k, v, visible = _case(4, 1, L, S, 16, None, seed=L)
        attend_chunk(q.bfloat16(), k.bfloat16(), v.bfloat16(), visible, 0.25)
    rows = {a[1] for a, _ in seen}
    assert seen, "the matmul path never ran"
    assert len(seen) <= 3 * 4 * 4 and rows <= {4 * b for b in (128, 256, 384, 512)}, sorted(seen)
