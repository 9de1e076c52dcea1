"""The canonical QuantizedWeight form: quantize_* error bounds, the dequantize reference, concat."""

from __future__ import annotations

import pytest
import torch

from freetoken.ops import GROUP, QuantizedWeight, concat, dequantize, quantize_int4, quantize_int8

FP16_REL = 2.0**-11  # float16 rounding of a scale or minimum, relative


def _group_view(t: torch.Tensor) -> torch.Tensor:
    return t.float().reshape(t.shape[0], -1, GROUP)  # [N, G, 32]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_int8_error_within_half_a_step(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    w = (torch.randn(37, 640) * torch.rand(37, 1) * 3).to(dtype)
    w[3] = 0  # an all-zero row: scale 0, q 0
    qw = quantize_int8(w)
    assert qw.bits == 8 and qw.minimum is None and qw.q.dtype == torch.int8
    assert qw.q.abs().max() <= 127
    err = _group_view(dequantize(qw) - w.float()).abs()
    s = qw.scale.float().unsqueeze(2)
    # half a step, plus the float16 rounding of the scale magnified by |q| <= 127
    assert (err <= s * (0.5 + 127 * FP16_REL) + 1e-12).all()
    assert (dequantize(qw)[3] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_int4_error_within_half_a_step(dtype: torch.dtype) -> None:
    torch.manual_seed(1)
    w = (torch.randn(41, 576) + torch.randn(41, 1)).to(dtype)
    w[5, :GROUP] = 0.25  # a constant group: scale 0, exact through the minimum
    qw = quantize_int4(w)
    assert qw.bits == 4 and qw.minimum is not None
    assert qw.q.min() >= 0 and qw.q.max() <= 15
    err = _group_view(dequantize(qw) - w.float()).abs()
    s, m = qw.scale.float().unsqueeze(2), qw.minimum.float().unsqueeze(2)
    bound = s * (0.5 + 15 * FP16_REL) + m.abs() * FP16_REL + 1e-7
    assert (err <= bound).all()
    assert (dequantize(qw)[5, :GROUP] == 0.25).all()


def test_dequantize_is_float32_math_then_one_rounding() -> None:
    torch.manual_seed(2)
    qw = quantize_int4(torch.randn(8, 64))
    ref = (qw.q.float().reshape(8, 2, GROUP) * qw.scale.float()[:, :, None] + qw.minimum.float()[:, :, None])
    assert torch.equal(dequantize(qw), ref.reshape(8, 64))
    assert torch.equal(dequantize(qw, torch.bfloat16), ref.reshape(8, 64).bfloat16())


def test_concat_mixed_bits_promotes_4bit_exactly() -> None:
    torch.manual_seed(3)
    a = quantize_int8(torch.randn(5, 96))  # symmetric 8-bit
    b = quantize_int4(torch.randn(7, 96))  # 4-bit with minimum
    c = quantize_int4(torch.randn(2, 96))
    fused = concat([a, b, c])
    assert fused.bits == 8 and fused.minimum is not None and fused.q.shape == (14, 96)
    assert torch.equal(dequantize(fused), torch.cat([dequantize(p) for p in (a, b, c)]))
    same = concat([b, c])
    assert same.bits == 4 and torch.equal(dequantize(same), torch.cat([dequantize(b), dequantize(c)]))
    sym = concat([a, quantize_int8(torch.randn(3, 96))])
    assert sym.bits == 8 and sym.minimum is None


def test_concat_rejects_mismatched_in_features() -> None:
    with pytest.raises(ValueError):
        concat([quantize_int8(torch.randn(2, 64)), quantize_int8(torch.randn(2, 96))])


def test_quantized_weight_validates_shapes() -> None:
    with pytest.raises(ValueError):
        QuantizedWeight(bits=8, q=torch.zeros(2, 40, dtype=torch.int8), scale=torch.zeros(2, 1).half(), minimum=None)
    with pytest.raises(ValueError):
        QuantizedWeight(bits=8, q=torch.zeros(2, 64, dtype=torch.int8), scale=torch.zeros(2, 1).half(), minimum=None)
