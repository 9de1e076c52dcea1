"""The C++ decode attention (csrc/attention.cpp) against a float64 reference: strided query heads,
grouped KV heads, masks that hide garbage slots, head sizes 64 / 256, key counts that are not a
multiple of 16; and the SDPA backend's decode batches against the plain-torch backend."""

from __future__ import annotations

import pytest
import torch

import freetoken.ops.attention as attention


def test_the_extension_is_built_and_used() -> None:
    """`pip install -e .` builds it on Linux and this CPU has AVX-512 or AVX2: a silent fallback would hide a broken build."""
    assert attention._KERNEL is not None


def reference(q, k_cache, v_cache, slots, visible, scale) -> torch.Tensor:  # type: ignore[no-untyped-def]
    B, H, D = q.shape
    n_kv = k_cache.shape[-2]
    hidden = ~visible[:, :, None, None]
    k = k_cache.reshape(-1, n_kv, D).double()[slots].masked_fill(hidden, 0)  # [B, S, n_kv, D]
    v = v_cache.reshape(-1, n_kv, D).double()[slots].masked_fill(hidden, 0)
    k = k.repeat_interleave(H // n_kv, dim=2)  # [B, S, H, D]
    v = v.repeat_interleave(H // n_kv, dim=2)
    s = torch.einsum("bhd,bshd->bhs", q.double(), k) * scale
    s = s.masked_fill(~visible[:, None, :], float("-inf"))
    return torch.einsum("bhs,bshd->bhd", s.softmax(-1), v).to(q.dtype)


def case(dtype: torch.dtype, B: int, H: int, n_kv: int, D: int, S: int, seed: int):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(seed)
    pool = 4 * S + 16
    k_cache = torch.randn(pool, n_kv, D, generator=g).to(dtype)
    v_cache = torch.randn(pool, n_kv, D, generator=g).to(dtype)
    qkv = (torch.randn(B, (H + 2 * n_kv) * D, generator=g) * 2).to(dtype)
    q = qkv[:, : H * D].view(B, H, D)  # strided rows, as split_qkv makes them
    slots = torch.randint(1, pool, (B, S), generator=g)
    visible = torch.rand(B, S, generator=g) < 0.7
    visible[:, 0] = True  # every real row sees at least its own key
    # Hidden keys point at rows full of NaN: the kernel must never read them.
    poisoned = torch.full((1, n_kv, D), float("nan"), dtype=dtype)
    k_cache[0:1], v_cache[0:1] = poisoned, poisoned
    slots = torch.where(visible, slots, torch.zeros_like(slots))
    return q, k_cache, v_cache, slots, visible


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
# head_dim 64 / 128 / 256 sum the values in registers, the others (16, 96) through memory; 300 keys
# run far past the kernel's 16-key prefetch distance.
@pytest.mark.parametrize(("B", "H", "n_kv", "D", "S"), [
    (1, 4, 1, 256, 100), (5, 9, 3, 64, 37), (3, 8, 8, 64, 16), (2, 2, 1, 16, 1), (2, 8, 2, 128, 300), (1, 6, 2, 96, 50),
])
def test_matches_the_float64_reference(dtype: torch.dtype, B: int, H: int, n_kv: int, D: int, S: int) -> None:
    q, k_cache, v_cache, slots, visible = case(dtype, B, H, n_kv, D, S, seed=B * 100 + S)
    got = attention.decode_attention(q, k_cache, v_cache, slots, visible, 0.125)
    assert got is not None and got.dtype == dtype and got.shape == (B, H, D)
    want = reference(q, k_cache, v_cache, slots, visible, 0.125)
    tol = 2 ** -7 if dtype == torch.bfloat16 else 1e-5  # one bf16 rounding; float32 sums
    torch.testing.assert_close(got.double(), want.double(), rtol=tol, atol=tol)


def test_large_scores_are_stable() -> None:
    """Scores far from zero (max subtracted before exp) and keys whose weight underflows to zero."""
    q, k_cache, v_cache, slots, visible = case(torch.float32, 2, 4, 2, 64, 50, seed=7)
    got = attention.decode_attention(q * 40, k_cache, v_cache, slots, visible, 1.0)
    want = reference(q * 40, k_cache, v_cache, slots, visible, 1.0)
    assert got is not None and torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_tensors_it_cannot_take_fall_back() -> None:
    q, k_cache, v_cache, slots, visible = case(torch.float32, 1, 2, 1, 64, 8, seed=1)
    assert attention.decode_attention(q.double(), k_cache.double(), v_cache.double(), slots, visible, 1.0) is None
    assert attention.decode_attention(q, k_cache.bfloat16(), v_cache.bfloat16(), slots, visible, 1.0) is None
    odd = torch.randn(1, 2, 24)
    assert attention.decode_attention(odd, torch.randn(4, 1, 24), torch.randn(4, 1, 24), slots[:, :2], visible[:, :2], 1.0) is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_write_kv_stores_rows_like_index_copy(dtype: torch.dtype) -> None:
    """Strided k / v views of a fused projection land in the slots given, nothing else changes;
    a slot outside the pool is refused before anything is written past it."""
    g = torch.Generator().manual_seed(2)
    pools = [torch.randn(9, 4, 2, 32, generator=g).to(dtype) for _ in range(2)]
    qkv = torch.randn(3, 6 * 64, generator=g).to(dtype)
    k, v = qkv[:, 128:192].view(3, 2, 32), qkv[:, 192:256].view(3, 2, 32)
    slots = torch.tensor([5, 17, 30])
    want = [p.clone().view(-1, 2, 32).index_copy_(0, slots, x) for p, x in zip(pools, (k, v))]
    assert attention.write_kv(pools[0], pools[1], slots, k, v)
    assert torch.equal(pools[0].view(-1, 2, 32), want[0]) and torch.equal(pools[1].view(-1, 2, 32), want[1])
    with pytest.raises(RuntimeError, match="outside the pool"):
        attention.write_kv(pools[0], pools[1], torch.tensor([1, 2, 36]), k, v)
    assert not attention.write_kv(pools[0], pools[1], slots, k.float() if dtype == torch.bfloat16 else k.double(), v)
