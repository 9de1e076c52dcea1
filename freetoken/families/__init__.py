"""Model families, as the layers below the models know them: one module per family.

Each module of this package that defines `FAMILY` (a `base.Family`) is a family; the package
finds them itself, so adding a family adds a module here and edits no list. The lookups below are
how the generic code asks about a family: `weights/gguf_config.py`, `weights/names.py` and
`tokenizer/gguf_vocab.py` by GGUF architecture, `server/preflight.py` by `config.json` model_type,
`models/config.py`, `models/registry.py` and `models/shard.py` by `ModelConfig.architecture`, the
tokenizer's built-in chat template and the tool parser's choice by any of those names (`named`).
Torch-free (the API process imports it); the
model code of a family is in `models/` (docs/architecture.md, "Adding a model family").
"""

from __future__ import annotations

import functools
import importlib
import pkgutil

from freetoken.errors import ModelLoadError
from freetoken.families.base import Family, GGUFFacts

__all__ = [
    "Family",
    "GGUFFacts",
    "all_families",
    "by_model_type",
    "family",
    "find_gguf",
    "gguf_architectures",
    "gguf_facts",
    "named",
]


@functools.cache
def all_families() -> tuple[Family, ...]:
    """Every family of the package, in module-name order; names, model_types and GGUF
    architectures each belong to one family only, and so does any name of one kind that is
    another's of another kind (`named` finds one family by any)."""
    found: list[Family] = []
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{__name__}.{info.name}")
        fam = getattr(module, "FAMILY", None)
        if fam is not None:
            found.append(fam)
    for what, names in (
        ("family name", [f.name for f in found]),
        ("model_type", [t for f in found for t in f.model_types]),
        ("GGUF architecture", [f.gguf.arch for f in found if f.gguf is not None]),
        ("name", [n for f in found for n in f.names]),
    ):
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise RuntimeError(f"more than one family claims the {what} {', '.join(twice)}")
    return tuple(found)


def family(name: str) -> Family | None:
    """The family whose `ModelConfig.architecture` is `name`."""
    return next((f for f in all_families() if f.name == name), None)


def named(name: str) -> Family | None:
    """The family that goes by `name`: its own name (`ModelConfig.architecture`), one of its
    `config.json` model_types or its GGUF architecture."""
    return next((f for f in all_families() if name in f.names), None)


def by_model_type(model_type: str) -> Family | None:
    """The family whose reader reads a `config.json` of this `model_type`."""
    return next((f for f in all_families() if model_type in f.model_types), None)


def gguf_architectures() -> tuple[str, ...]:
    """The GGUF `general.architecture` values FreeToken runs."""
    return tuple(f.gguf.arch for f in all_families() if f.gguf is not None)


def find_gguf(arch: str) -> GGUFFacts | None:
    """The GGUF facts of architecture `arch` (`general.architecture`); None when no family runs it."""
    return next((f.gguf for f in all_families() if f.gguf is not None and f.gguf.arch == arch), None)


def gguf_facts(arch: str) -> GGUFFacts:
    """The GGUF facts of architecture `arch`; ModelLoadError "unsupported architecture: X" when
    no family runs it."""
    facts = find_gguf(arch)
    if facts is None:
        raise ModelLoadError(f"unsupported architecture: {arch}")
    return facts
