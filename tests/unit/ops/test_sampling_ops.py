"""The sampler's whole-row passes (csrc/sampling.cpp) against the torch ops they replace."""

from __future__ import annotations

import pytest
import torch

from freetoken.ops import sampling


def test_the_extension_is_built_and_used() -> None:
    """`pip install -e .` builds it on Linux; a silent fallback here would hide a broken build."""
    assert sampling._KERNEL is not None


def torch_stats(x: torch.Tensor, temps: torch.Tensor | None, mass: torch.Tensor, block: int, monkeypatch: pytest.MonkeyPatch):
    with monkeypatch.context() as m:
        m.setattr(sampling, "_KERNEL", None)
        return sampling.row_stats_(x, temps, mass, block)


def float64_log_mass(x: torch.Tensor) -> torch.Tensor:
    xd = x.double()
    return (xd - xd.amax(dim=-1, keepdim=True)).exp().sum(dim=-1).log()


@pytest.mark.parametrize("vocab", [1, 15, 64, 1000, 4096 + 16, 262144])
@pytest.mark.parametrize("scaled", [False, True])
def test_kernel_equals_torch(vocab: int, scaled: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(4, vocab, generator=g) * 4
    x[1, 1::3] = float("-inf")  # grammar-masked tokens (the first stays: a row keeps one)
    x[2] = x[2].bfloat16().float()  # ties, as a bfloat16 model emits them
    x[3, vocab // 2] = 40.0  # one token far above the rest
    temps = torch.tensor([0.7, 1.0, 1.3, 0.05]) if scaled else None
    mass = torch.tensor([True, True, True, False])
    a, b = x.clone(), x.clone()
    row_max, log_mass, block_max = sampling.row_stats_(a, temps, mass, 64)
    t_max, t_mass, t_blocks = torch_stats(b, temps, mass, 64, monkeypatch)
    assert torch.equal(a, b)  # x / t: IEEE division on both paths
    assert torch.equal(row_max, t_max)
    assert (block_max is None) == (t_blocks is None) == (vocab % 64 != 0)
    if block_max is not None:
        assert torch.equal(block_max, t_blocks)
    assert log_mass[3] == 0.0  # not asked for
    exact = float64_log_mass(a[:3])
    assert torch.allclose(log_mass[:3], exact, rtol=0, atol=2e-6), (log_mass[:3] - exact)
    assert torch.allclose(t_mass[:3], exact, rtol=0, atol=2e-5)


def test_other_tensors_take_the_torch_path() -> None:
    x = torch.randn(2, 128, dtype=torch.float64)
    row_max, log_mass, block_max = sampling.row_stats_(x, None, torch.tensor([True, False]), 64)
    assert row_max.dtype == torch.float64 and block_max is not None and block_max.shape == (2, 2)
    strided = torch.randn(128, 2).t()  # not contiguous
    row_max, _, _ = sampling.row_stats_(strided, torch.tensor([2.0, 2.0]), torch.tensor([False, False]), 64)
    assert torch.equal(row_max, strided.amax(dim=-1))


def test_bad_arguments_raise() -> None:
    with pytest.raises(RuntimeError, match="mass must be bool"):
        sampling._KERNEL.row_stats_(torch.randn(2, 8), None, torch.tensor([1, 0]), 0)
    with pytest.raises(RuntimeError, match="temps must be float32"):
        sampling._KERNEL.row_stats_(torch.randn(2, 8), torch.ones(3), torch.tensor([True, False]), 0)


@pytest.mark.parametrize("vocab", [1, 15, 1000, 1024, 3 * 1024 + 123, 262144])
def test_exp_block_sums_match_torch(vocab: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The temperature-only draw's weights exp(x - max), in place, and their block sums (a short last
    block, masked tokens, a token far above the rest) against torch's exp and float64 sums."""
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(3, vocab, generator=g) * 4
    x[1, 1::3] = float("-inf")
    x[2, vocab // 2] = 40.0
    row_max = x.amax(dim=-1)
    a, b = x.clone(), x.clone()
    sums = sampling.exp_block_sums_(a, row_max, 1024)
    with monkeypatch.context() as m:
        m.setattr(sampling, "_KERNEL", None)
        t_sums = sampling.exp_block_sums_(b, row_max, 1024)
    blocks = -(-vocab // 1024)
    assert sums.shape == t_sums.shape == (3, blocks)
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-30)  # the kernel's exp: ~1 ulp
    assert bool((a[x == float("-inf")] == 0).all()) and bool((a.amax(dim=-1) == 1).all())
    padded = torch.nn.functional.pad((x.double() - row_max.double()[:, None]).exp(), (0, blocks * 1024 - vocab))
    want = padded.view(3, blocks, 1024).sum(dim=-1)
    torch.testing.assert_close(sums.double(), want, rtol=1e-5, atol=1e-30)
    torch.testing.assert_close(t_sums.double(), want, rtol=1e-5, atol=1e-30)
