"""The sampler's whole-row passes (csrc/sampling.cpp) against the torch ops they replace."""

from __future__ import annotations

import math

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


def full_sort_cut(x: torch.Tensor, log_mass: float, top_p: float, min_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The filter the deep cut computes, by a float64 sort of the whole row: rank by logit (ties by
    ascending id), keep rank r while the mass before it (exp(x - max - log_mass)) is < top_p (1: off)
    and exp(x - max) >= min_p; rank 0 always. Kept ids ascending, their renormalised probabilities."""
    vals, order = x.double().sort(descending=True, stable=True)
    rel = (vals - vals[0]).exp()
    before = torch.cat([torch.zeros(1, dtype=torch.float64), (rel * math.exp(-log_mass)).cumsum(0)[:-1]])
    keep = ((before < top_p) | (top_p >= 1.0)) & (rel >= min_p)
    keep[0] = True
    m = int(keep.long().cumprod(0).sum())  # the filters keep a prefix of the ranks
    ids, by_id = order[:m].sort()
    return ids, (rel[:m] / rel[:m].sum())[by_id]


@pytest.mark.parametrize("vocab", [1, 15, 16, 17, 300, 4097])
def test_deep_cut_is_the_full_sort_cut_on_both_paths(vocab: int) -> None:
    """The kernel's deep cut (AVX-512 and plain) against a float64 sort of the row: short rows and
    rows off the vector width, tie groups (bfloat16), -inf tokens, top_p and min_p alone and
    together. Probabilities to float64 rounding (relative 1e-12)."""
    g = torch.Generator().manual_seed(vocab)
    rows = [torch.randn(vocab, generator=g) * 0.5, (torch.randn(vocab, generator=g) * 3).bfloat16().float()]
    masked = torch.randn(vocab, generator=g)
    masked[1::3] = float("-inf")
    rows.append(masked)
    for x in rows:
        m = float(x.max())
        log_mass = float(torch.logsumexp(x.double() - m, 0))
        for top_p, min_p in ((0.9, 0.0), (0.3, 0.0), (1.0, 0.05), (0.95, 0.02), (0.6, 0.5), (1.0, 0.0)):
            want_ids, want_probs = full_sort_cut(x, log_mass, top_p, min_p)
            for simd in (True, False):
                ids, probs = sampling._KERNEL.deep_cut(x, m, log_mass, vocab, top_p, min_p, simd)
                assert torch.equal(ids, want_ids), (top_p, min_p, simd, ids.tolist()[:10], want_ids.tolist()[:10])
                torch.testing.assert_close(probs, want_probs, rtol=1e-12, atol=0)


def test_deep_cut_declines_what_it_does_not_decide() -> None:
    """A NaN, a logit above the given max, a non-finite max or normaliser, top_k on (the deep cut
    serves rows without it): two empty tensors from the kernel, None from the op, and the
    sampler's torch path decides. So do other dtypes and strided rows."""
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    m = float(x.max())
    log_mass = float(torch.logsumexp(x.double() - m, 0))
    nan = x.clone()
    nan[17] = float("nan")
    assert sampling.deep_cut(x, m, log_mass, 1000, 0.9, 0.0) is not None
    for args in [
        (nan, m, log_mass, 1000, 0.9, 0.0),
        (nan, m, 0.0, 1000, 1.0, 0.05),
        (x, m - 0.5, log_mass, 1000, 0.9, 0.0),
        (x, float("inf"), log_mass, 1000, 0.9, 0.0),
        (x, m, float("nan"), 1000, 0.9, 0.0),
        (x, m, log_mass, 999, 0.9, 0.0),
    ]:
        assert sampling.deep_cut(*args) is None
        ids, probs = sampling._KERNEL.deep_cut(*args, False)
        assert ids.numel() == probs.numel() == 0
    assert sampling.deep_cut(x.double(), m, log_mass, 1000, 0.9, 0.0) is None
    assert sampling.deep_cut(torch.randn(2000)[::2], m, log_mass, 1000, 0.9, 0.0) is None
