"""GGUF metadata as plain Python values, and the one way FreeToken opens a GGUF file.

Owns the turning of read failures into one-line ModelLoadErrors, and hands out the file's
key/value section as a `dict[str, object]` of str, int, float, bool and lists of those (the binary
parse lives in gguf_file.py). It reads no tensor data and knows nothing of architectures.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from freetoken.errors import ModelLoadError
from freetoken.weights.gguf_file import GGUFFile, GGUFFormatError, read_gguf_metadata

T = TypeVar("T")


def _read(path: str | Path, reader: Callable[[Path], T]) -> T:
    p = Path(path)
    if not p.is_file():
        raise ModelLoadError(f"model file not found: {p}")
    try:
        return reader(p)
    except GGUFFormatError as err:
        raise ModelLoadError(f"{p} is not a readable GGUF file ({err})") from None
    except (OSError, ValueError, OverflowError) as err:  # e.g. an empty file cannot be mapped
        raise ModelLoadError(f"{p} is not a readable GGUF file ({type(err).__name__}: {err})") from None


def open_gguf(path: str | Path) -> GGUFFile:
    """Open a GGUF file (memory-mapped) and parse its header, metadata and tensor directory."""
    return _read(path, GGUFFile)


def metadata_of(reader: GGUFFile) -> dict[str, object]:
    """Every key/value field of the file, decoded; array fields become lists."""
    return dict(reader.metadata)


def read_metadata(path: str | Path) -> dict[str, object]:
    """The metadata of the GGUF file at `path` (reads only the key/value section)."""
    return _read(path, read_gguf_metadata)
