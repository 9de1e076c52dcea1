"""Paged attention: batch metadata, the plain-torch reference backend, the fused SDPA backend and,
on CUDA, the Triton decode backend.

Owns choosing the backend (`attention_fn`), the one place the model path asks which function runs
attention. Every backend shares `torch_backend.paged_attention`'s signature; the reference stays
reachable by name for tests and audits. The Triton backend is imported only when chosen (triton
is optional), and whether it imports is decided once per process.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from freetoken.attention import sdpa_backend, torch_backend
from freetoken.errors import ConfigError

PagedAttentionFn = Callable[..., torch.Tensor]
BACKENDS: tuple[str, ...] = ("auto", "triton", "sdpa", "torch")


@functools.cache
def triton_fn() -> PagedAttentionFn | None:
    """The Triton backend's function, or None where triton does not import."""
    try:
        from freetoken.attention import triton_backend
    except ImportError:
        return None
    return triton_backend.paged_attention


def attention_fn(device: torch.device | str, backend: str = "auto") -> PagedAttentionFn:
    """The paged-attention function for tensors on `device`.

    "auto" is the Triton backend on CUDA where triton imports (SDPA there otherwise), SDPA on CPU
    and the reference elsewhere; "triton", "sdpa" and "torch" force one (Triton off CUDA only under
    its interpreter, for tests). Raises ConfigError for an unknown backend name, or for "triton"
    where triton does not import.
    """
    if backend not in BACKENDS:
        raise ConfigError(f"unknown attention backend {backend!r}; expected one of {BACKENDS}")
    if backend == "torch":
        return torch_backend.paged_attention
    kind = torch.device(device).type
    if backend == "triton" or (backend == "auto" and kind == "cuda"):
        fn = triton_fn()
        if fn is not None:
            return fn
        if backend == "triton":
            raise ConfigError("attention backend 'triton' needs the triton package")
    if backend == "sdpa" or kind in ("cpu", "cuda"):
        return sdpa_backend.paged_attention
    return torch_backend.paged_attention
