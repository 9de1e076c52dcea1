"""Test helper: write small GGUF files the way llama.cpp's converter lays them out."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import gguf
import numpy as np
import torch

Value = bool | int | float | str | list[str] | list[int] | list[bool]


def write_gguf(
    path: Path,
    arch: str,
    kv: Mapping[str, Value],
    tensors: Mapping[str, np.ndarray | tuple[np.ndarray, gguf.GGMLQuantizationType]],
) -> Path:
    """A GGUF file with `general.architecture = arch`, the given metadata (keys without a
    `general.` or `tokenizer.` prefix get `<arch>.`), and tensors (float32 arrays, or raw bytes
    with their GGML type)."""
    w = gguf.GGUFWriter(path, arch)
    for key, value in kv.items():
        full = key if key.startswith(("general.", "tokenizer.")) else f"{arch}.{key}"
        if isinstance(value, bool):
            w.add_bool(full, value)
        elif isinstance(value, int):
            w.add_uint32(full, value)
        elif isinstance(value, float):
            w.add_float32(full, value)
        elif isinstance(value, str):
            w.add_string(full, value)
        else:
            w.add_array(full, value)
    for name, t in tensors.items():
        if isinstance(t, tuple):
            w.add_tensor(name, t[0], raw_dtype=t[1])
        else:
            w.add_tensor(name, np.ascontiguousarray(t, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def llama_cpp_permute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """llama.cpp's row permutation of a Llama q/k projection (HF half-split rotary -> interleaved)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def np32(t: torch.Tensor) -> np.ndarray:
    return t.detach().to(torch.float32).contiguous().numpy()
