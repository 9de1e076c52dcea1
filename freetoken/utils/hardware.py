"""What the hardware does fast: the `--dtype auto` rule and the torch device to use.

Owns the choice of compute dtype from the machine; it never changes global torch state.
"""

from __future__ import annotations

from pathlib import Path

import torch

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


def cpu_has_fast_bf16() -> bool:
    """True when the CPU has AVX512-BF16 (or AMX), where bfloat16 matmuls beat float32."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def default_threads() -> int:
    """The physical cores this process may run on: torch's intra-op threads default to this, so
    hyper-threads and cores outside the affinity mask are never oversubscribed."""
    import os

    import psutil

    allowed = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    logical = psutil.cpu_count(logical=True) or allowed
    physical = psutil.cpu_count(logical=False) or logical
    # Within the affinity mask, count a core once even when both of its threads are allowed.
    return max(1, min(physical, round(allowed * physical / logical)))


def default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """`auto` is bfloat16 where the hardware does it fast (CUDA, a CPU with AVX512-BF16), else
    float32. float16 is never chosen on CPU: it is ~100x slower there."""
    if name == "auto":
        if device.type == "cuda" or (device.type == "cpu" and cpu_has_fast_bf16()):
            return torch.bfloat16
        return torch.float32
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose auto, {', '.join(DTYPES)}")
    return DTYPES[name]
