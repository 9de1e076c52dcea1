"""A checkpoint's tensors as its headers list them, without reading any tensor's data.

Owns `inventory(source)`: per tensor its name, storage type (a GGML type name such as `Q4_K`, or
a safetensors dtype such as `BF16`), shape and bytes in the file — what a memory estimate before
loading needs (models/memory.py). It does not decode, rename or interpret tensors.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

from freetoken.errors import ModelLoadError
from freetoken.weights.safetensors import shard_files
from freetoken.weights.source import ModelSource


@dataclass(frozen=True)
class TensorEntry:
    name: str
    storage: str  # GGML type name (`Q4_K`, `F16`, ...) or safetensors dtype (`BF16`, `F32`, ...)
    shape: tuple[int, ...]  # torch order, outermost first
    n_bytes: int

    @property
    def n_elements(self) -> int:
        return math.prod(self.shape)


def _safetensors_header(path: Path) -> list[TensorEntry]:
    try:
        with path.open("rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
    except (OSError, ValueError, struct.error) as err:
        raise ModelLoadError(f"{path} is not a readable safetensors file ({err})") from None
    return [
        TensorEntry(name, str(info["dtype"]), tuple(info["shape"]), info["data_offsets"][1] - info["data_offsets"][0])
        for name, info in header.items()
        if name != "__metadata__"
    ]


def inventory(source: ModelSource) -> list[TensorEntry]:
    """Every tensor of the checkpoint, from the file headers alone."""
    if source.kind == "safetensors":
        return [entry for path in shard_files(source.path) for entry in _safetensors_header(path)]
    from freetoken.weights.dequant import type_name
    from freetoken.weights.gguf_metadata import open_gguf

    return [
        TensorEntry(t.name, type_name(t.ggml_type), tuple(t.shape), t.n_bytes) for t in open_gguf(source.path).tensors
    ]
