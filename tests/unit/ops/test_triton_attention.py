"""The Triton paged decode attention (freetoken/ops/triton_attention.py) against the plain-torch
backend, the numerical oracle (attention/torch_backend.py), on small shapes: full and sliding-window
layers, grouped-query attention, page tables as the KV manager hands them out (scattered pages,
NULL entries before the window, unwritten page tails full of NaN), float, int8 and float8_e4m3 K/V
read in place with their per-(slot, head, 32-block) scales, sinks, soft-capping, and split counts
that leave some splits empty. On CPU under Triton's interpreter; compiled on a CUDA device."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from triton_env import DEVICE, require_triton  # noqa: E402

require_triton()

from freetoken.attention import torch_backend  # noqa: E402
from freetoken.attention.metadata import ForwardBatch  # noqa: E402
from freetoken.kv.tensors import KVLayout, KVTensors  # noqa: E402
from freetoken.ops.triton_attention import paged_decode, splits_for  # noqa: E402

FP8 = getattr(torch, "float8_e4m3fn", None)


def quantized_pool(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x [pages + 1, P, n_kv, D] stored as kv/tensors.py stores an 8-bit cache: per (slot, head,
    block of 32) a float16 scale = max |x| / qmax, attached as `.kv_scale`."""
    qmax = 127.0 if dtype == torch.int8 else 448.0
    pages, P, n_kv, D = x.shape
    nb = D // 32 if D % 32 == 0 else 1
    xf = x.float().view(pages, P, n_kv, nb, D // nb)
    scale = (xf.abs().amax(dim=-1) / qmax).to(torch.float16).clamp_min(1e-7)
    q = xf / scale.float().unsqueeze(-1)
    if dtype == torch.int8:
        q = q.round().clamp(-qmax, qmax)
    stored = q.to(dtype).view(x.shape)
    stored.kv_scale = scale  # type: ignore[attr-defined]
    return stored


def case(seed: int, P: int, H: int, n_kv: int, D: int, window: int | None, lens: list[int], kv: str):
    """Pools (page 0 zero), one decode query per request at position len - 1, tables of scattered
    pages; unwritten tails NaN (float pools); out-of-window SWA pages NULL."""
    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    n_pages = sum(-(-n // P) for n in lens) + 3
    k = torch.randn(n_pages + 1, P, n_kv, D, generator=g)
    v = torch.randn(n_pages + 1, P, n_kv, D, generator=g)
    k[0] = v[0] = 0
    free = list(rng.permutation(np.arange(1, n_pages + 1)))
    specs = []
    for n in lens:
        table = np.array([free.pop() for _ in range(-(-n // P))], dtype=np.int32)
        if n % P and kv == "float":
            k[table[-1], n % P :] = float("nan")
            v[table[-1], n % P :] = float("nan")
        if window is not None:
            for i in range(len(table)):
                if (i + 1) * P <= n - window:  # every token of page i out of the query's window
                    table[i] = 0
        specs.append((n - 1, 1, table, table if window is not None else None))
    q = torch.randn(len(lens), H, D, generator=g)
    if kv == "int8":
        k, v = quantized_pool(k, torch.int8), quantized_pool(v, torch.int8)
    elif kv == "fp8":
        k, v = quantized_pool(k, FP8), quantized_pool(v, FP8)
    return q, k, v, specs


def to_device(t: torch.Tensor) -> torch.Tensor:
    out = t.to(DEVICE)
    if hasattr(t, "kv_scale"):
        out.kv_scale = t.kv_scale.to(DEVICE)  # type: ignore[attr-defined]
    return out


def run_both(q, k, v, specs, P, window, dtype, sinks=None, softcap=None, splits=None):  # type: ignore[no-untyped-def]
    batch = ForwardBatch.build(specs, P, sliding_window=window)
    table = batch.swa_table if window is not None else batch.full_table
    want = torch_backend.paged_attention(
        q.double(), k, v, table, batch, 0.3, sliding_window=window, sinks=sinks, softcap=softcap
    )
    got = paged_decode(
        to_device(q.to(dtype)),
        to_device(k),
        to_device(v),
        table.to(DEVICE),
        batch.kv_lens.to(DEVICE),
        0.3,
        sliding_window=window,
        sinks=None if sinks is None else sinks.to(DEVICE),
        softcap=softcap,
        splits=splits,
    )
    assert got.dtype == dtype and got.shape == q.shape
    return got.cpu().double(), want


TOL = {torch.float32: 1e-5, torch.bfloat16: 2**-7, torch.float16: 2**-10}


@pytest.mark.parametrize(
    ("P", "H", "n_kv", "D", "window", "lens"),
    [
        (16, 4, 4, 32, None, [1, 17, 40]),  # no grouping; lengths at, past and inside a page
        (16, 8, 2, 64, None, [100, 3]),  # GQA 4:1
        (4, 6, 2, 48, None, [29, 8]),  # G = 3 (padded to 4), D = 48 (padded to 64), small pages
        (16, 4, 1, 32, 24, [90, 10, 24, 25]),  # sliding: NULL pages before the window, a window inside a page
        (8, 2, 2, 16, 5, [33]),  # a window shorter than a page
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_float_pool_matches_the_torch_backend(P, H, n_kv, D, window, lens, dtype) -> None:  # type: ignore[no-untyped-def]
    q, k, v, specs = case(P * 7 + D, P, H, n_kv, D, window, lens, "float")
    got, want = run_both(q, k.to(dtype), v.to(dtype), specs, P, window, dtype)
    assert torch.isfinite(got).all()  # the NaN tails were never read
    torch.testing.assert_close(got, want, rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize("kv", ["int8", "fp8"])
@pytest.mark.parametrize(("D", "window"), [(64, None), (64, 20), (48, None)])  # 48: one scale per head
def test_8bit_pool_is_read_in_place_with_its_scales(kv: str, D: int, window: int | None) -> None:
    if kv == "fp8" and FP8 is None:
        pytest.fail("this torch has no float8_e4m3fn")
    q, k, v, specs = case(11 + D, 16, 8, 2, D, window, [70, 33, 5], kv)
    got, want = run_both(q, k, v, specs, 16, window, torch.float32)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # same stored values, same scales


def test_sinks_and_softcap() -> None:
    q, k, v, specs = case(5, 16, 4, 2, 32, None, [50, 9], "float")
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0])
    got, want = run_both(q, k, v, specs, 16, None, torch.float32, sinks=sinks, softcap=3.0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("splits", [1, 3, 16])  # 16 splits of 40 keys: most splits are empty
def test_split_counts_agree(splits: int) -> None:
    q, k, v, specs = case(9, 8, 4, 2, 32, None, [40, 2], "float")
    got, want = run_both(q, k, v, specs, 8, None, torch.float32, splits=splits)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_kv_tensors_int8_layout_is_what_the_kernel_reads() -> None:
    """The pool KVTensors writes for --kv-cache-dtype int8, read by the kernel as the oracle reads it."""
    layout = KVLayout(sliding=(False,), num_kv_heads=2, head_dim=64)
    kvt = KVTensors(layout, 8, 0, 16, torch.float32, "cpu", "int8")
    g = torch.Generator().manual_seed(3)
    slots = torch.arange(16, 16 + 37)  # pages 1-3
    kvt.write(0, slots, torch.randn(37, 2, 64, generator=g), torch.randn(37, 2, 64, generator=g))
    specs = [(36, 1, np.array([1, 2, 3], dtype=np.int32), None)]
    q = torch.randn(1, 4, 64, generator=g)
    got, want = run_both(q, kvt.k[0], kvt.v[0], specs, 16, None, torch.float32)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_split_choice_fills_small_batches_and_stops_at_large_ones() -> None:
    assert splits_for(1, 8) == 16
    assert splits_for(4, 8) == 8
    assert splits_for(64, 8) == 1


def test_the_backend_sends_decode_batches_to_the_kernel_and_the_rest_to_sdpa(monkeypatch: pytest.MonkeyPatch) -> None:
    """attention_fn(..., "triton"): a decode batch runs the kernel, a mixed batch SDPA; both agree
    with the oracle."""
    from freetoken.attention import attention_fn, triton_backend

    fn = attention_fn(DEVICE, "triton")
    assert fn is triton_backend.paged_attention
    calls: list[int] = []
    real = triton_backend.paged_decode
    monkeypatch.setattr(triton_backend, "paged_decode", lambda q, *a, **k: calls.append(q.shape[0]) or real(q, *a, **k))
    g = torch.Generator().manual_seed(1)
    P, n_kv, D = 8, 2, 32
    k = torch.randn(20, P, n_kv, D, generator=g)
    v = torch.randn(20, P, n_kv, D, generator=g)
    k[0] = v[0] = 0
    tables = [np.array([3, 7, 1], dtype=np.int32), np.array([5, 2], dtype=np.int32)]
    for specs in ([(19, 1, tables[0], None), (9, 1, tables[1], None)], [(19, 1, tables[0], None), (4, 6, tables[1], None)]):
        batch = ForwardBatch.build(specs, P)
        q = torch.randn(batch.num_tokens, 4, D, generator=g)
        want = torch_backend.paged_attention(q.double(), k, v, batch.full_table, batch, 0.2)
        dev = ForwardBatch.build(specs, P, device=DEVICE)
        got = fn(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), dev.full_table, dev, 0.2)
        torch.testing.assert_close(got.cpu().double(), want, rtol=1e-5, atol=1e-5)
    assert calls == [2]  # the decode batch only
