"""Lazily zeroed CPU tensors (utils/zeroed.py): zero where never written, writable, freed with
the last tensor on them, and the same shapes and dtypes torch.zeros gives."""

from __future__ import annotations

import gc

import pytest
import torch

from freetoken.utils import zeroed


def _mapped_bytes() -> int:
    """Bytes of this process's anonymous private maps (the only kind zeroed.zeros makes)."""
    total = 0
    with open("/proc/self/smaps") as f:
        for line in f:
            if line.startswith("Size:"):
                total += int(line.split()[1]) * 1024
    return total


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int8, torch.float16])
def test_a_large_tensor_is_zero_contiguous_and_writable(dtype: torch.dtype) -> None:
    shape = (33, 64, 8, 64)  # >= MIN_BYTES for every dtype here
    t = zeroed.zeros(shape, dtype)
    assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
    assert t.untyped_storage().nbytes() >= zeroed.MIN_BYTES
    assert torch.count_nonzero(t) == 0
    t[3, 5] = 7
    assert torch.count_nonzero(t) == 8 * 64  # that one slot, nothing else
    assert torch.equal(t[4], torch.zeros(shape[1:], dtype=dtype))


def test_a_small_tensor_takes_torch_zeros() -> None:
    t = zeroed.zeros((3, 4), torch.float32)
    assert torch.equal(t, torch.zeros(3, 4))
    assert t.untyped_storage().nbytes() == 48


def test_the_map_is_released_with_the_last_tensor_on_it() -> None:
    gc.collect()
    before = _mapped_bytes()
    t = zeroed.zeros((64, 1024, 1024), torch.uint8)  # 64 MiB
    view = t[10:20]
    del t
    gc.collect()
    assert _mapped_bytes() >= before + (64 << 20)  # a view still holds it
    assert int(view.sum()) == 0
    del view
    gc.collect()
    assert _mapped_bytes() < before + (64 << 20)
