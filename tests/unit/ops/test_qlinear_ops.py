"""qlinear on every path (the C++ kernel, the torch fallbacks, the large-M tiles) against
dequantize + float64 matmul, within the error bound each path states; PackedWeight.rows; and that
the kernel really runs on a CPU that has the features (a silent fallback fails here).

Bounds (per output element, r = the float64 reference, |x|·|w| = sum_k |x_k w_k|):
- kernel: activations quantized per 32-group, so |error| <= sum_k |w_k| * amax_group(x) / 254,
  + 1e-5 |x|·|w| (float32 sums) + the output's rounding (bf16: 2^-8 |r|).
- dequantize + F.linear / tiles: the weight rounded to x's dtype: 2^-8 |x|·|w| for bf16
  (1e-5 for float32), + the output's rounding.
- torch int4pack: its scales and zeros (zero = minimum + 8 scale) are bf16, so 2^-8 times
  sum_k |x_k| (|q_k - 8| scale + |zero|) on top of the bf16 bound.
"""

from __future__ import annotations

import gc
import subprocess
import sys
import weakref
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from freetoken.ops import GROUP, PackedWeight, QuantizedWeight, concat, dequantize, kernel_available, qlinear
from freetoken.ops import quantize_int4, quantize_int8

ROWS = (1, 2, 3, 7, 16, 17, 64)
FALLBACK_ROWS = (1, 17, 64)
SHAPES = ((1, 32), (5, 64), (300, 576), (5, 640), (1, 2048), (300, 640), (16, 96), (3, 768), (2, 416))  # (N, K)
KINDS = ("int8", "int8+min", "int4", "int5", "int5+min")
QLINEAR = sys.modules["freetoken.ops.qlinear"]  # the module (the package exports the function under its name)


def _cpu_has_kernel_features() -> bool:
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.is_file():
        return False
    flags = next((ln.split(":", 1)[1].split() for ln in cpuinfo.read_text().splitlines() if ln.startswith("flags")), [])
    avx512 = {"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "f16c", "fma"}
    return avx512 <= set(flags) or {"avx2", "f16c", "fma"} <= set(flags)  # the AVX2 kernel otherwise


def _weight(kind: str, n: int, k: int, seed: int) -> QuantizedWeight:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05 + torch.randn(n, 1, generator=g) * 0.01
    if kind == "int8":
        return quantize_int8(w)
    if kind == "int4":
        return quantize_int4(w)
    if kind.startswith("int5"):  # GGUF Q5_0 (minimum: a Q5_0 part fused beside a part with one)
        q = torch.randint(-16, 16, (n, k), generator=g, dtype=torch.int8)
        scale = (torch.rand(n, k // GROUP, generator=g) * 1e-2).half()
        minimum = (torch.randn(n, k // GROUP, generator=g) * 1e-2).half() if kind.endswith("min") else None
        return QuantizedWeight(bits=8, q=q, scale=scale, minimum=minimum)
    # 8-bit with a minimum (like GGUF Q5_1 / Q5_K): q in [-128, 127], some rows promoted 4-bit.
    q = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    scale = (torch.rand(n, k // GROUP, generator=g) * 1e-3).half()
    minimum = (torch.randn(n, k // GROUP, generator=g) * 1e-2).half()
    return QuantizedWeight(bits=8, q=q, scale=scale, minimum=minimum)


def _bound(path: str, x: torch.Tensor, qw: QuantizedWeight, r: torch.Tensor) -> torch.Tensor:
    xd, wd = x.double(), dequantize(qw).double()
    mag = xd.abs() @ wd.abs().t()
    out_round = 2.0**-8 if x.dtype == torch.bfloat16 else 1e-6
    bound = out_round * r.abs() + 1e-5 * mag + 1e-9
    if path == "kernel":
        m, k = x.shape
        amax = xd.reshape(m, k // GROUP, GROUP).abs().amax(dim=2).repeat_interleave(GROUP, dim=1)  # [M, K]
        return bound + (amax / 254) @ wd.abs().t()
    if x.dtype == torch.bfloat16:
        bound = bound + 2.0**-8 * mag
    if path == "int4pack":
        s = qw.scale.double().repeat_interleave(GROUP, dim=1)
        zero = (qw.minimum.double() + 8 * qw.scale.double()).repeat_interleave(GROUP, dim=1)
        bound = bound + 2.0**-8 * (xd.abs() @ ((qw.q.double() - 8).abs() * s + zero.abs()).t())
    return bound


def _paths(p: PackedWeight, qw: QuantizedWeight) -> dict[str, Callable[..., torch.Tensor]]:
    paths: dict[str, Callable[..., torch.Tensor]] = {
        "dispatch": lambda x, b: qlinear(x, p, b),
        "dequantized": p._dequantized_linear,
        "tiled": p._tiled_linear,
    }
    if kernel_available():
        paths["kernel"] = p._kernel
    if qw.bits == 4 and p.out_features % 16 == 0:
        p.int4pack = p._torch_int4pack(qw)  # what a CPU without the kernel would build
        paths["int4pack"] = p._int4pack_or_dequantized
    return paths


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_every_path_within_its_bound(kind: str, dtype: torch.dtype) -> None:
    for si, (n, k) in enumerate(SHAPES):
        qw = _weight(kind, n, k, seed=si)
        p = PackedWeight.from_quantized(qw)
        wd = dequantize(qw).double()
        paths = _paths(p, qw)
        for m in ROWS:
            g = torch.Generator().manual_seed(100 * si + m)
            x = torch.randn(m, k, generator=g).to(dtype)
            bias = torch.randn(n, generator=g).to(dtype) if m % 2 else None
            r = x.double() @ wd.t() + (bias.double() if bias is not None else 0)
            for name, fn in paths.items():
                if name not in ("kernel", "dispatch") and m not in FALLBACK_ROWS:
                    continue  # the torch paths do not depend on M; keep the module fast
                y = fn(x, bias)
                assert y.shape == (m, n) and y.dtype == dtype, (name, y.shape, y.dtype)
                kind_of = ("kernel" if kernel_available() else "dequantized") if name == "dispatch" else name
                if name == "int4pack" and dtype == torch.float32:
                    kind_of = "dequantized"  # torch's float32 int4 path is scalar: it dequantizes instead
                excess = ((y.double() - r).abs() - _bound(kind_of, x, qw, r)).max().item()
                assert excess <= 0, f"{name} {kind} {dtype} N={n} K={k} M={m}: exceeds bound by {excess:.3g}"


def test_non_contiguous_input_gives_the_same_result() -> None:
    qw = _weight("int8", 64, 640, seed=9)
    p = PackedWeight.from_quantized(qw)
    x = torch.randn(640, 4).t()  # [4, 640], not contiguous
    assert torch.allclose(qlinear(x, p), qlinear(x.contiguous(), p))


@pytest.mark.parametrize("kind", KINDS)
def test_rows_and_dequantize_match_the_reference_exactly(kind: str) -> None:
    for si, (n, k) in enumerate(SHAPES):
        qw = _weight(kind, n, k, seed=si)
        p = PackedWeight.from_quantized(qw)
        read_as = 5 if kind.startswith("int5") and QLINEAR._FIVE_BITS else qw.bits
        assert (p.out_features, p.in_features, p.bits) == (n, k, read_as)
        assert torch.equal(p.dequantize(torch.float32), dequantize(qw))
        ids = torch.tensor([n - 1, 0, n // 2, n - 1])
        for dtype in (torch.bfloat16, torch.float32):
            assert torch.equal(p.rows(ids, dtype), dequantize(qw, dtype)[ids])
        assert torch.equal(p.rows(ids.reshape(2, 2)), p.rows(ids).reshape(2, 2, k))


def test_a_dropped_weight_is_freed_at_once() -> None:
    """No reference cycle: an evicted expert's memory returns without the garbage collector."""
    gc.disable()
    try:
        for qw in (quantize_int8(torch.randn(32, 64)), quantize_int4(torch.randn(32, 64))):
            p = PackedWeight.from_quantized(qw)
            qlinear(torch.randn(2, 64), p)
            ref = weakref.ref(p)
            del p
            assert ref() is None
    finally:
        gc.enable()


def test_nbytes_is_the_packed_size() -> None:
    p8 = PackedWeight.from_quantized(quantize_int8(torch.randn(10, 64)))
    p4 = PackedWeight.from_quantized(quantize_int4(torch.randn(10, 64)))
    assert p8.nbytes == 10 * 64 + 10 * 2 * 2
    assert p4.nbytes == 10 * 32 + 10 * 2 * 2 * 2
    if QLINEAR._FIVE_BITS:  # 8-bit integers in [-16, 15] are read as 5 bits: 5/8 of the bytes
        p5 = PackedWeight.from_quantized(_weight("int5", 10, 2048, 0))
        assert p5.nbytes == 10 * 2048 * 5 // 8 + 10 * 64 * 2


def test_fused_mixed_bits_weight_runs_on_every_path() -> None:
    parts = [_weight("int8", 48, 640, 1), _weight("int4", 16, 640, 2), _weight("int4", 16, 640, 3)]
    fused = concat(parts)
    p = PackedWeight.from_quantized(fused)
    x = torch.randn(3, 640).bfloat16()
    r = x.double() @ dequantize(fused).double().t()
    for name, fn in _paths(p, fused).items():
        kind_of = "kernel" if name in ("kernel", "dispatch") and kernel_available() else "dequantized"
        assert ((fn(x, None).double() - r).abs() <= _bound(kind_of, x, fused, r)).all(), name


@pytest.mark.skipif(not _cpu_has_kernel_features(), reason="CPU lacks AVX2 / FMA / F16C")
def test_the_kernel_is_used_on_a_cpu_with_the_features() -> None:
    assert kernel_available(), "freetoken.ops._qlinear_cpu did not build or load: run `pip install -e .`"
    p = PackedWeight.from_quantized(quantize_int4(torch.randn(32, 64)))
    assert p._small is PackedWeight._kernel and "kernel" in repr(p)
    assert QLINEAR._FIVE_BITS, "the built kernel predates 5-bit weights: rerun `pip install -e .`"


def test_a_missing_extension_means_the_torch_fallback_and_one_log_line() -> None:
    code = (
        "import logging, sys, torch\n"
        "logging.basicConfig(level=logging.INFO, format='%(name)s: %(message)s')\n"
        "sys.modules['freetoken.ops._qlinear_cpu'] = None  # as if the compile had failed\n"
        "from freetoken.ops import PackedWeight, kernel_available, qlinear, quantize_int4, quantize_int8\n"
        "assert not kernel_available()\n"
        "for qw in (quantize_int8(torch.randn(32, 64)), quantize_int4(torch.randn(32, 64))):\n"
        "    p = PackedWeight.from_quantized(qw)\n"
        "    assert 'torch' in repr(p)\n"
        "    for m in (1, 64):\n"
        "        assert qlinear(torch.randn(m, 64).bfloat16(), p).shape == (m, 32)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = [ln for ln in done.stderr.splitlines() if ln.startswith("freetoken.ops")]
    assert len(lines) == 1 and "torch fallback" in lines[0], done.stderr


def test_dense_prefill_rows_are_padded_to_a_bucket() -> None:
    """Prefill-sized GEMMs see row counts in multiples of ROW_BUCKET only (oneDNN keeps memory per
    shape: unbounded chunk lengths grew RSS), and the result is x's rows."""
    from freetoken.models import linear as lin

    seen: list[int] = []
    real = lin.F.linear

    def spy(x, w, b=None):  # type: ignore[no-untyped-def]
        seen.append(x.shape[0])
        return real(x, w, b)

    torch.manual_seed(0)
    w, b = torch.randn(48, 32, dtype=torch.float64), torch.randn(48, dtype=torch.float64)
    lin.F.linear = spy
    try:
        for rows in (8, 64, 65, 100, 128):
            x = torch.randn(rows, 32, dtype=torch.float64)
            torch.testing.assert_close(lin.dense_linear(x, w, b), x @ w.T + b)
    finally:
        lin.F.linear = real
    assert seen == [8, 64, 96, 128, 128]
