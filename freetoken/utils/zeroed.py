"""Zero-filled CPU tensors whose memory is zeroed when first touched, not when allocated.

Owns one allocation: an anonymous private memory map (`mmap.mmap(-1, n)`), which the kernel
hands out as zero pages on demand, wrapped as a tensor. `torch.zeros` of the same size writes
every byte at once: a 16k-token K/V pool of a 1.1B model (~0.5 GB) cost ~0.4 s of a start that
way, and its whole size showed in the resident memory before a single token was cached. Here a
page costs its zeroing when a request first writes it, and pages never written cost nothing.
The tensor keeps the map alive; the map is unmapped when the last tensor on it is freed. Other
devices (CUDA) and small sizes take `torch.zeros`. It does not decide what is allocated.
"""

from __future__ import annotations

import math
import mmap

import torch

MIN_BYTES = 1 << 20  # below this a map's page rounding and call cost are not worth it


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """A contiguous zero tensor of `shape` and `dtype`: lazily zeroed pages on the CPU."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if torch.device(device).type != "cpu" or nbytes < MIN_BYTES:
        return torch.zeros(shape, dtype=dtype, device=device)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(shape)
