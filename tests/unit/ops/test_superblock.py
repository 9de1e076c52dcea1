"""Super-block (GGUF Q4_K / Q6_K) weights in their own integers: the loader's translation is exact
against gguf's own dequantization, the kernel layout round-trips, `sbmm` is within the stated bound
of dequantize + float64 matmul at every row count, fused projections of mixed types keep each
part's form, and slicing for tensor parallelism keeps the form.

Bound (as the group-32 kernel's, tests/unit/ops/test_qlinear_ops.py): activations quantized per
32-group, so |error| <= sum_k |w_k| amax_group(x) / 254, + 1e-5 |x|.|w| (float32 sums) + the
output's rounding (bf16: 2^-8 |r|).
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import quants

from freetoken.ops import qlinear
from freetoken.ops.qlinear import PackedWeight, kernel_available, pack
from freetoken.ops.quantized import StackedWeight, SuperBlockWeight, concat, dequantize, quantize_int8
from freetoken.ops.superblock import PackedStack, PackedSuperBlock, pack_values, unpack_values
from freetoken.weights.requant import to_superblocks

Q = gguf.GGMLQuantizationType
ROWS = (1, 2, 3, 5, 8, 9, 17, 64)
SHAPES = ((1, 256), (48, 256), (35, 768), (16, 2048), (7, 1280))  # (N, K): K % 512 == 256 too


def _blocks(qtype: Q, n: int, k: int, seed: int) -> np.ndarray:
    """Random block bytes of a [n, k] matrix (any byte pattern is a valid block, bar its float16
    scales, which are set to small positive values)."""
    rng = np.random.default_rng(seed)
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (n * k // block_size, type_size), dtype=np.uint8)
    for at in ((0, 2) if qtype == Q.Q4_K else (208,)):
        scales = (rng.random(raw.shape[0]) * 0.01).astype(np.float16)
        raw[:, at : at + 2] = np.frombuffer(scales.tobytes(), np.uint8).reshape(-1, 2)
    return raw.reshape(-1)


def _weight(kind: str, n: int, k: int, seed: int = 0) -> SuperBlockWeight:
    qtype = Q.Q4_K if kind == "q4_k" else Q.Q6_K
    return to_superblocks(_blocks(qtype, n, k, seed), qtype, (n, k))


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K])
def test_translation_is_exact(qtype: Q) -> None:
    raw = _blocks(qtype, 6, 1024, seed=1)
    w = to_superblocks(raw, qtype, (6, 1024))
    reference = quants.dequantize(raw.reshape(6, -1), qtype)  # gguf's own numpy dequantization
    assert np.array_equal(dequantize(w).numpy(), reference)


@pytest.mark.parametrize("kind", ["q4_k", "q6_k"])
@pytest.mark.parametrize("n,k", SHAPES)
def test_layout_round_trips(kind: str, n: int, k: int) -> None:
    w = _weight(kind, n, k)
    back = unpack_values(kind, *pack_values(w), k)
    for a, b in ((w.q, back.q), (w.sc, back.sc), (w.d, back.d), (w.m, back.m), (w.dmin, back.dmin)):
        assert (a is None and b is None) or torch.equal(a, b)


def _bound(x: torch.Tensor, w: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    m, k = x.shape
    amax = x.double().reshape(m, -1, 32).abs().amax(dim=2).repeat_interleave(32, dim=1)  # [M, K]
    out_rounding = 2.0**-8 if x.dtype == torch.bfloat16 else 1e-6
    return amax @ w.abs().t() / 254 + 1e-5 * (x.double().abs() @ w.abs().t()) + out_rounding * ref.abs() + 1e-30


@pytest.mark.skipif(not kernel_available(), reason="needs the C++ kernel (AVX-512 VNNI)")
@pytest.mark.parametrize("kind", ["q4_k", "q6_k"])
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_within_bound(kind: str, n: int, k: int, dtype: torch.dtype) -> None:
    w = _weight(kind, n, k, seed=n + k)
    packed = pack(w)
    assert isinstance(packed, PackedSuperBlock)
    ref_w = dequantize(w, torch.float64)
    bias = torch.randn(n).to(dtype)
    for m in ROWS:
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
        y = qlinear(x, packed, bias)
        assert y.dtype == dtype and y.shape == (m, n)
        ref = x.double() @ ref_w.t() + bias.double()
        err = (y.double() - ref).abs()
        assert (err <= _bound(x, ref_w, ref)).all(), (m, (err / _bound(x, ref_w, ref)).max().item())


@pytest.mark.skipif(not kernel_available(), reason="needs the C++ kernel (AVX-512 VNNI)")
def test_bytes_per_weight_are_the_files() -> None:
    """Resident bytes within ~3% of the file's: Q4_K 0.5625 and Q6_K 0.8203 bytes per weight, also
    where a row ends in half a chunk (K = 768, an MoE expert's down projection: padded to whole
    chunks it was 1.33x the file's)."""
    for kind, file_bytes in (("q4_k", 144 / 256), ("q6_k", 210 / 256)):
        for k in (2048, 768, 256):
            packed = pack(_weight(kind, 64, k))
            per_weight = packed.nbytes / (64 * k)
            assert file_bytes <= per_weight <= file_bytes * 1.03 + 40 / 512 * (k % 512 != 0), (kind, k, per_weight)


@pytest.mark.skipif(not kernel_available(), reason="needs the C++ kernel (AVX-512 VNNI)")
def test_rows_and_dequantize_are_exact() -> None:
    for kind in ("q4_k", "q6_k"):
        w = _weight(kind, 40, 768)
        packed = pack(w)
        ids = torch.tensor([[3, 0], [39, 3]])
        assert torch.equal(packed.rows(ids, torch.float32), dequantize(w)[ids])
        assert torch.equal(packed.dequantize(torch.float32), dequantize(w))


def test_concat_keeps_each_parts_form() -> None:
    q, k, v = _weight("q4_k", 32, 512, 1), _weight("q4_k", 16, 512, 2), _weight("q6_k", 16, 512, 3)
    same = concat([q, k])
    assert isinstance(same, SuperBlockWeight) and same.kind == "q4_k" and same.shape == (48, 512)
    mixed = concat([q, k, v])
    assert isinstance(mixed, StackedWeight)
    assert [p.kind for p in mixed.parts] == ["q4_k", "q6_k"]  # q and k merged into one row block
    assert torch.equal(dequantize(mixed), torch.cat([dequantize(q), dequantize(k), dequantize(v)]))
    g32 = quantize_int8(torch.randn(8, 512))
    assert [type(p) for p in concat([q, g32]).parts] == [SuperBlockWeight, type(g32)]


@pytest.mark.skipif(not kernel_available(), reason="needs the C++ kernel (AVX-512 VNNI)")
def test_stacked_projection_matches_its_parts() -> None:
    q, v = _weight("q4_k", 32, 512, 1), _weight("q6_k", 16, 512, 3)
    g32 = quantize_int8(torch.randn(8, 512))
    packed = pack(concat([q, v, g32]))
    assert isinstance(packed, PackedStack) and packed.format == "q4_k + q6_k + int8"
    x = torch.randn(3, 512)
    parts = [qlinear(x, pack(q)), qlinear(x, pack(v)), qlinear(x, PackedWeight(g32))]
    bias = torch.randn(56)
    assert torch.equal(qlinear(x, packed, bias), torch.cat(parts, dim=1) + bias)
    assert torch.equal(packed.dequantize(torch.float32), dequantize(concat([q, v, g32])))


def test_slices_keep_the_form() -> None:
    w = _weight("q4_k", 12, 1024)
    assert torch.equal(dequantize(w.cols(256, 768)), dequantize(w)[:, 256:768])
    rows = w.map_rows(lambda t: t[4:9])
    assert torch.equal(dequantize(rows), dequantize(w)[4:9])
    with pytest.raises(ValueError):
        w.cols(32, 512)


def test_group32_fallback_is_close() -> None:
    """Without the kernel a super-block weight runs in the group-32 form: q4_k keeps its nibbles
    (scales rounded to float16), q6_k is requantized to absmax int8 per 32."""
    for kind in ("q4_k", "q6_k"):
        w = _weight(kind, 16, 512)
        exact, approx = dequantize(w), dequantize(w.to_group32())
        scale = exact.abs().reshape(16, -1, 32).amax(dim=2).repeat_interleave(32, dim=1)
        assert ((approx - exact).abs() <= scale / 254 + 2**-10 * exact.abs() + 1e-7).all()
