"""The Triton group-32 int4 / int8 weight-only matmul (freetoken/ops/triton_qlinear.py) against
`ops.quantized.dequantize` (the oracle) and a float64 matmul, on small shapes: decode row counts
(1 to 70), N and K that are not multiples of the tiles, symmetric and asymmetric weights, bias,
split-K; the layout's round trip; and `qlinear.pack` choosing it where the Triton path is wanted.
On CPU under Triton's interpreter (products in float32 there); compiled on a CUDA device."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from triton_env import CUDA, DEVICE, require_triton  # noqa: E402

require_triton()

import importlib  # noqa: E402

qlinear_mod = importlib.import_module("freetoken.ops.qlinear")  # the module (freetoken.ops.qlinear is also a function's name)

from freetoken.ops.quantized import QuantizedWeight, SuperBlockWeight, dequantize, on_device, quantize_int4, quantize_int8  # noqa: E402
from freetoken.ops.triton_qlinear import TritonPackedWeight, pack_rows, qmm, unpack_rows  # noqa: E402


def weight(kind: str, n: int, k: int, seed: int) -> QuantizedWeight:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    if kind == "int4":
        return quantize_int4(w)
    qw = quantize_int8(w)
    if kind == "int8_min":  # an 8-bit weight with a minimum (GGUF Q5_1 / Q5_K)
        return QuantizedWeight(8, qw.q, qw.scale, (torch.rand(n, k // 32, generator=g) - 0.5).half())
    return qw


def want(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    y = x.double() @ dequantize(qw, torch.float64).t()
    return y + bias.double() if bias is not None else y


@pytest.mark.parametrize("kind", ["int4", "int8", "int8_min"])
@pytest.mark.parametrize(("m", "n", "k"), [(1, 64, 128), (5, 104, 96), (17, 40, 288), (70, 130, 160)])
def test_matches_dequantize_in_float32(kind: str, m: int, n: int, k: int) -> None:
    qw = weight(kind, n, k, seed=m * n + k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    bias = torch.randn(n) if m % 2 else None
    pw = TritonPackedWeight(on_device(qw, DEVICE))
    got = pw._small(pw, x.to(DEVICE), None if bias is None else bias.to(DEVICE))
    assert got.dtype == torch.float32 and got.shape == (m, n)
    # float32 products and sums (CUDA: IEEE dot), against float64
    torch.testing.assert_close(got.cpu().double(), want(x, qw, bias), rtol=1e-4, atol=1e-4 * k**0.5)


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_bfloat16_activations(kind: str) -> None:
    qw = weight(kind, 96, 256, seed=4)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(2)).bfloat16()
    pw = TritonPackedWeight(on_device(qw, DEVICE))
    got = pw._small(pw, x.to(DEVICE), None)
    assert got.dtype == torch.bfloat16
    ref = want(x.float(), qw, None)
    # CPU: float32 products, one bf16 rounding; CUDA: weights rounded to bf16 on the tensor cores too
    tol = 2**-7 if not CUDA else 2**-6
    torch.testing.assert_close(got.cpu().double(), ref, rtol=tol, atol=tol * ref.abs().max().item())


@pytest.mark.parametrize("split_k", [1, 2, 3, 7])  # 7 splits of 10 blocks: the last holds fewer
def test_split_k_sums_agree(split_k: int) -> None:
    qw = weight("int4", 64, 1280, seed=9)
    x = torch.randn(2, 1280, generator=torch.Generator().manual_seed(1))
    packed = pack_rows(qw.q, 4).to(DEVICE)
    got = qmm(x.to(DEVICE), packed, qw.scale.to(DEVICE), qw.minimum.to(DEVICE), 4, split_k=split_k)
    torch.testing.assert_close(got.cpu().double(), want(x, qw, None), rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("kind", ["int4", "int8", "int8_min"])
def test_layout_round_trips_and_rows_dequantize_as_the_oracle(kind: str) -> None:
    qw = weight(kind, 24, 64, seed=3)
    assert torch.equal(unpack_rows(pack_rows(qw.q, qw.bits), qw.bits), qw.q)
    pw = TritonPackedWeight(qw)
    assert pw.nbytes == pw.packed.numel() * pw.packed.element_size() + 2 * (pw.scale.numel() * (2 if qw.minimum is not None else 1))
    torch.testing.assert_close(pw.dequantize(torch.float32), dequantize(qw, torch.float32), rtol=0, atol=0)
    ids = torch.tensor([[3, 0], [23, 3]])
    torch.testing.assert_close(pw.rows(ids, torch.float32), dequantize(qw, torch.float32)[ids], rtol=0, atol=0)
    back = TritonPackedWeight.from_state(pw.state())
    assert back.format == f"int{qw.bits}" and torch.equal(back.packed, pw.packed)


def test_pack_chooses_the_triton_layout_where_it_is_wanted(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA `qlinear.pack` gives the Triton layout (forced here on CPU, where the interpreter runs
    it); super-block weights go through their group-32 form; `from_state` rebuilds it."""
    monkeypatch.setattr(qlinear_mod, "_wants_triton", lambda device: True)
    qw = weight("int4", 64, 256, seed=5)
    packed = qlinear_mod.pack(on_device(qw, DEVICE))
    assert isinstance(packed, TritonPackedWeight)
    x = torch.randn(4, 256).to(DEVICE)
    torch.testing.assert_close(qlinear_mod.qlinear(x, packed).cpu().double(), want(x.cpu(), qw, None), rtol=1e-4, atol=1e-3)
    assert isinstance(qlinear_mod.from_state(packed.state()), TritonPackedWeight)
    g = torch.Generator().manual_seed(6)
    sb = SuperBlockWeight(
        "q4_k",
        torch.randint(0, 16, (32, 256), generator=g, dtype=torch.int8),
        torch.randint(0, 64, (32, 8), generator=g, dtype=torch.uint8),
        (torch.rand(32, 1, generator=g) / 50).half(),
        torch.randint(0, 64, (32, 8), generator=g, dtype=torch.uint8),
        (torch.rand(32, 1, generator=g) / 50).half(),
    )
    packed = qlinear_mod.pack(on_device(sb, DEVICE))
    assert isinstance(packed, TritonPackedWeight) and packed.bits == 4
    torch.testing.assert_close(packed.dequantize().cpu(), dequantize(sb.to_group32()), rtol=0, atol=0)
