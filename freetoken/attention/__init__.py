"""Paged attention: batch metadata, the plain-torch reference backend and the fused SDPA backend.

Owns choosing the backend (`attention_fn`), the one place the model path asks which function runs
attention. Both backends share `torch_backend.paged_attention`'s signature; the reference stays
reachable by name for tests and audits.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from freetoken.attention import sdpa_backend, torch_backend
from freetoken.errors import ConfigError

PagedAttentionFn = Callable[..., torch.Tensor]
BACKENDS: tuple[str, ...] = ("auto", "sdpa", "torch")


def attention_fn(device: torch.device | str, backend: str = "auto") -> PagedAttentionFn:
    """The paged-attention function for tensors on `device`.

    "auto" is SDPA on CPU and CUDA and the reference elsewhere; "sdpa" and "torch" force one.
    Raises ConfigError for an unknown backend name.
    """
    if backend not in BACKENDS:
        raise ConfigError(f"unknown attention backend {backend!r}; expected one of {BACKENDS}")
    if backend == "torch":
        return torch_backend.paged_attention
    if backend == "sdpa" or torch.device(device).type in ("cpu", "cuda"):
        return sdpa_backend.paged_attention
    return torch_backend.paged_attention
