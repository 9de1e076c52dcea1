"""The C++ RMSNorm and rotary ops (csrc/layers.cpp) against the torch reference they replace,
in float64: bfloat16 results within one bfloat16 rounding, float32 within float32 rounding."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import freetoken.ops.layers as layers



def test_the_extension_is_built_and_used() -> None:
    """`pip install -e .` builds it on Linux; a silent fallback here would hide a broken build."""
    assert layers._KERNEL is not None


def reference_norm(x: torch.Tensor, w: torch.Tensor, eps: float, after_cast: bool) -> torch.Tensor:
    xd = x.double()
    normed = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps)
    if after_cast:
        return (normed.to(x.dtype).double() * w.double()).to(x.dtype)
    return (normed * w.double()).to(x.dtype)


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    tol = 2 ** -7 if got.dtype == torch.bfloat16 else 1e-5  # one bf16 rounding; float32 sums
    torch.testing.assert_close(got.double(), want.double(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("after_cast", [False, True])
def test_rms_norm_rows_and_strided_heads(dtype: torch.dtype, after_cast: bool) -> None:
    torch.manual_seed(0)
    w = torch.randn(256).to(dtype).float()  # model-dtype values held in float32
    x = (torch.randn(7, 640) * 3).to(dtype)[:, :256]  # strided rows
    close(layers.rms_norm(x, w, 1e-6, after_cast), reference_norm(x, w, 1e-6, after_cast))
    qkv = torch.randn(5, 6 * 256).to(dtype)
    heads = qkv[:, : 4 * 256].view(5, 4, 256)  # q heads of a fused projection: [T, H, D] view
    got = layers.rms_norm(heads, w, 1e-6, after_cast)
    close(got, reference_norm(heads, w, 1e-6, after_cast))
    assert got.is_contiguous()


def test_rms_norm_falls_back_for_float64() -> None:
    x, w = torch.randn(3, 64, dtype=torch.float64), torch.randn(64, dtype=torch.float64)
    want = F.rms_norm(x, (64,), None, 1e-5) * w
    torch.testing.assert_close(layers.rms_norm(x, w, 1e-5), want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rope_in_place_on_a_strided_view(dtype: torch.dtype) -> None:
    torch.manual_seed(1)
    T, H, D = 6, 3, 64
    qkv = torch.randn(T, (H + 2) * D).to(dtype)
    x = qkv[:, : H * D].view(T, H, D)
    angles = torch.rand(T, D // 2) * 6
    cos, sin = angles.cos(), angles.sin()
    x1, x2 = x.double().chunk(2, dim=-1)
    c, s = cos.double()[:, None], sin.double()[:, None]
    want = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(dtype)
    untouched = qkv[:, H * D :].clone()
    out = layers.rope_(x, cos, sin)
    assert out.data_ptr() == x.data_ptr()
    close(x, want)
    assert torch.equal(qkv[:, H * D :], untouched)  # the rest of the row is left alone


def test_bad_arguments_raise() -> None:
    with pytest.raises(RuntimeError, match="float32 \\[D\\]"):
        layers._KERNEL.rms_norm(torch.randn(2, 8), torch.randn(4), 1e-6, False)
    with pytest.raises(RuntimeError, match="last dimension"):
        layers._KERNEL.rope_(torch.randn(8, 2, 4).transpose(0, 2), torch.randn(4, 1), torch.randn(4, 1))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("after_cast", [False, True])
@pytest.mark.parametrize("norm_h", [False, True])
def test_add_rms_norm_equals_the_ops_it_fuses(dtype: torch.dtype, after_cast: bool, norm_h: bool) -> None:
    """Bit for bit what the unfused path computes: the norm of h, the rounded sum, the norm of it."""
    torch.manual_seed(3)
    x, h = (torch.randn(3, 640) * 2).to(dtype), (torch.randn(3, 640) * 5).to(dtype)  # the C++ path's sizes
    wh, w = torch.randn(640).to(dtype).float(), torch.randn(640).to(dtype).float()
    got_x, got_y = layers.add_rms_norm(x, h, wh if norm_h else None, w, 1e-6, after_cast)
    want_x = x + (layers.rms_norm(h, wh, 1e-6, after_cast) if norm_h else h)
    assert torch.equal(got_x, want_x)
    assert got_y is not None and torch.equal(got_y, layers.rms_norm(want_x, w, 1e-6, after_cast))
    only_x, none = layers.add_rms_norm(x, h, wh, None, 1e-6, after_cast)
    assert none is None and torch.equal(only_x, x + layers.rms_norm(h, wh, 1e-6, after_cast))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("norms", [False, True])
def test_qk_norm_rope_equals_norms_then_rope(dtype: torch.dtype, norms: bool) -> None:
    """In place on the fused projection, bit for bit the unfused norms and rope; v untouched."""
    torch.manual_seed(5)
    T, H, n_kv, D = 3, 4, 2, 64
    qkv = (torch.randn(T, (H + 2 * n_kv) * D) * 2).to(dtype)
    wq, wk = torch.randn(D).to(dtype).float(), torch.randn(D).to(dtype).float()
    cos, sin = torch.randn(T, D // 2), torch.randn(T, D // 2)
    q, k = qkv[:, : H * D].reshape(T, H, D), qkv[:, H * D : (H + n_kv) * D].reshape(T, n_kv, D)
    if norms:
        q, k = layers.rms_norm(q, wq, 1e-6), layers.rms_norm(k, wk, 1e-6)
    want_q, want_k = layers.rope_(q.clone(), cos, sin), layers.rope_(k.clone(), cos, sin)
    want_v = qkv[:, (H + n_kv) * D :].clone()
    got = qkv.clone()
    assert layers.qk_norm_rope_(got, H, n_kv, wq if norms else None, wk if norms else None, 1e-6, False, cos, sin)
    assert torch.equal(got[:, : H * D].view(T, H, D), want_q)
    assert torch.equal(got[:, H * D : (H + n_kv) * D].view(T, n_kv, D), want_k)
    assert torch.equal(got[:, (H + n_kv) * D :], want_v)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_gated_act_is_torchs_ops_bit_for_bit(dtype: torch.dtype, act: str) -> None:
    assert layers._GATED_ACT  # the C++ call is what runs here
    torch_act = {"silu": F.silu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh")}[act]
    g = torch.Generator().manual_seed(3)
    for rows, inter in ((1, 1536), (3, 2048), (70, 100)):
        gate_up = (torch.randn(rows, 2 * inter, generator=g) * 4).to(dtype)
        gate, up = gate_up.chunk(2, dim=-1)
        got = layers.gated_act(gate_up, act)
        assert got.shape == (rows, inter) and got.dtype == dtype
        assert torch.equal(got, torch_act(gate) * up)
