"""GGUF metadata as plain Python values.

Owns the translation of a GGUF file's key/value section into a `dict[str, object]` of str, int,
float, bool and lists of those. It reads no tensor data and knows nothing of architectures.
"""

from __future__ import annotations

from pathlib import Path

import gguf

from freetoken.errors import ModelLoadError


def open_gguf(path: str | Path) -> gguf.GGUFReader:
    """Open a GGUF file (memory-mapped), turning any parse failure into a ModelLoadError."""
    p = Path(path)
    if not p.is_file():
        raise ModelLoadError(f"model file not found: {p}")
    try:
        return gguf.GGUFReader(p)
    except Exception as err:  # the gguf package raises ValueError, struct.error, IndexError...
        raise ModelLoadError(f"{p} is not a readable GGUF file ({type(err).__name__}: {err})") from None


def metadata_of(reader: gguf.GGUFReader) -> dict[str, object]:
    """Every key/value field of the file, decoded; array fields become lists."""
    out: dict[str, object] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        out[key] = field.contents()
    return out


def read_metadata(path: str | Path) -> dict[str, object]:
    """The metadata of the GGUF file at `path`."""
    return metadata_of(open_gguf(path))
