"""GGUF metadata as plain Python values, and the one way FreeToken opens a GGUF file.

Owns the turning of read failures into one-line ModelLoadErrors naming the file, and hands out the
file's key/value section as a `dict[str, object]` of str, int, float, bool and lists of those (the
binary parse and its checks live in gguf_file.py). `open_gguf` also validates the file against its
own metadata before any caller allocates anything for it: a supported architecture, every size and
count the config is built from a positive integer consistent with the others, `block_count` equal
to the blocks present, and the embedding, attention and MLP widths equal to the tensors' shapes
(gguf_config.py). It reads no tensor data.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from freetoken.errors import ModelLoadError
from freetoken.weights.gguf_config import check_tensor_shapes, hf_config_from_metadata
from freetoken.weights.gguf_file import GGUFFile, GGUFFormatError, read_gguf_metadata
from freetoken.weights.source import file_identity

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


# The last file opened, by its identity: an engine start opens its model four times (memory
# check, inventory, header, load), and a parse of a large vocabulary takes ~0.1 s. Held until
# `forget_opened`.
_last: tuple[list[object], GGUFFile] | None = None


def _identity(p: Path) -> list[object] | None:
    try:
        return file_identity(p)
    except OSError:
        return None


def open_gguf(path: str | Path) -> GGUFFile:
    """Open a GGUF file (memory-mapped), parse its header, metadata and tensor directory, and
    check the model it describes against its tensors (`check_model`). Opening the file just
    opened again, unchanged (same path, size and modification time), returns the same reader
    (read-only: callers never modify one)."""
    global _last
    p = Path(path)
    key = _identity(p)
    if key is not None and _last is not None and _last[0] == key:
        return _last[1]
    reader = _read(p, GGUFFile)
    check_model(p, reader)
    if key is not None:
        _last = (key, reader)
    return reader


def forget_opened() -> None:
    """Drop the reader `open_gguf` keeps for a reopen: its memory map would otherwise keep every
    page the load read counted as this process's resident memory. The load calls this when done."""
    global _last
    _last = None


def check_model(path: Path, reader: GGUFFile) -> None:
    """ModelLoadError `<path>: <what, naming the metadata field>` when the file's metadata does not
    describe a model its tensors can fill."""
    shapes = {t.name: t.shape for t in reader.tensors}
    try:
        config = hf_config_from_metadata(reader.metadata, shapes)
        check_tensor_shapes(reader.metadata, config, shapes)
    except ModelLoadError as err:
        raise ModelLoadError(f"{path}: {err}") from None


def metadata_of(reader: GGUFFile) -> dict[str, object]:
    """Every key/value field of the file, decoded; array fields become lists."""
    return dict(reader.metadata)


def read_metadata(path: str | Path) -> dict[str, object]:
    """The metadata of the GGUF file at `path` (reads only the key/value section)."""
    return _read(path, read_gguf_metadata)
