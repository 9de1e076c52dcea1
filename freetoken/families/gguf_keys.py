"""Typed reading of a GGUF file's `<arch>.<key>` metadata, for the families' translators.

Owns `Keys`: a key's value checked as an integer, a count (a size in [1, MAX_COUNT]), a finite
real or a positive scale, with one-line `ModelLoadError`s naming the full key when it is missing
or of the wrong kind. `weights/gguf_config.py` reads the keys every architecture shares with it,
and each family's `translate` (its `FAMILY.gguf`) reads its own. Torch-free; reads no file.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from freetoken.errors import ModelLoadError

_MISSING = object()
MAX_COUNT = 1 << 26  # any size or count in the metadata (a 64M-token context is past every model here)


class Keys:
    """Typed access to `<arch>.<key>` metadata with one-line errors for missing keys."""

    def __init__(self, metadata: Mapping[str, object], arch: str) -> None:
        self.md = metadata
        self.arch = arch

    def raw(self, key: str, default: object = _MISSING) -> object:
        full = key if key.startswith(("general.", "tokenizer.")) else f"{self.arch}.{key}"
        if full in self.md:
            return self.md[full]
        if default is _MISSING:
            raise ModelLoadError(f"GGUF metadata lacks {full}")
        return default

    def full(self, key: str) -> str:
        return key if key.startswith(("general.", "tokenizer.")) else f"{self.arch}.{key}"

    def integer(self, key: str, default: object = _MISSING) -> int:
        value = self.raw(key, default)
        if isinstance(value, list) and value:  # some files store per-layer values; the models here are uniform
            value = max(value, key=lambda v: v if _is_int(v) else 0)
        if not _is_int(value):
            raise ModelLoadError(f"{self.full(key)} is {_kind(value)}, not an integer")
        return int(value)  # type: ignore[arg-type]

    def count(self, key: str, default: object = _MISSING) -> int:
        """A size or count: an integer in [1, MAX_COUNT] (each entry, for a per-layer list)."""
        value = self.raw(key, default)
        for v in value if isinstance(value, list) else [value]:
            if not _is_int(v) or not 1 <= v <= MAX_COUNT:  # type: ignore[operator]
                raise ModelLoadError(f"{self.full(key)} is {_kind(v)}; it must be an integer from 1 to {MAX_COUNT}")
        return self.integer(key, default)

    def real(self, key: str, default: object = _MISSING) -> float:
        value = self.raw(key, default)
        if not _is_int(value) and not isinstance(value, float) or not math.isfinite(float(value)):  # type: ignore[arg-type]
            raise ModelLoadError(f"{self.full(key)} is {_kind(value)}, not a finite number")
        return float(value)  # type: ignore[arg-type]

    def positive(self, key: str, default: object = _MISSING) -> float:
        """A scale (a rope base or factor, a soft-cap): a finite number above 0."""
        value = self.real(key, default)
        if value <= 0:
            raise ModelLoadError(f"{self.full(key)} is {value!r}; it must be above 0")
        return value

    def optional_positive(self, key: str) -> float | None:
        return None if self.raw(key, None) is None else self.positive(key)

    def optional_integer(self, key: str) -> int | None:
        return None if self.raw(key, None) is None else self.integer(key)

    def optional_real(self, key: str) -> float | None:
        return None if self.raw(key, None) is None else self.real(key)

    def per_layer(self, key: str, layers: int) -> list[object]:
        """A key stored once or per layer, as one entry per layer (a list of another length is an error)."""
        value = self.raw(key)
        if not isinstance(value, list):
            return [value] * layers
        if len(value) != layers:
            raise ModelLoadError(f"{self.arch}.{key} has {len(value)} entries for {layers} layers")
        return value


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _kind(value: object) -> str:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return repr(value)
    if isinstance(value, list):
        return f"a list of {len(value)}"
    return f"a {type(value).__name__}"
