"""The model's own sampling defaults: what a checkpoint says to sample with, for the fields a
request leaves out (`ft serve --sampling-defaults model`, the default, and `LLM(...,
sampling_defaults="model")`; `none` keeps the APIs' defaults).

Owns `SamplingDefaults` (the values and where they came from; `apply` puts them into a request's
`SamplingParams` for the fields it left out), `checkpoint_sampling_defaults` (those of a model
source, by its kind) and `read_sampling_defaults` (from a Hugging Face
directory's `generation_config.json`: `temperature`, `top_p`, `top_k`, `min_p`,
`repetition_penalty`, `presence_penalty`; or from GGUF metadata's `general.sampling.*` keys that
llama.cpp's converters write: `temp`, `top_p`, `top_k`, `min_p`, `penalty_repeat`). As in vLLM,
`do_sample` is not read: a checkpoint's values are its recommendation. A value out of the engine's
ranges is left out with a warning. Reads plain JSON and an already-read metadata dict: no torch,
no model. Which fields a protocol's request leaves out is the server's (server/sampling_defaults.py).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from freetoken.request import SamplingParams
from freetoken.weights.gguf_metadata import open_gguf
from freetoken.weights.source import ModelSource

log = logging.getLogger("freetoken.weights")

FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty")
MODES = ("model", "none")
_GGUF_KEYS = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_p": "top_p",
    "general.sampling.top_k": "top_k",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
}


@dataclass(frozen=True)
class SamplingDefaults:
    """Per-field defaults (only the fields the checkpoint gives) and their source, for display."""

    values: Mapping[str, float | int] = field(default_factory=dict)
    source: str = ""

    def apply(self, params: SamplingParams, unset: Iterable[str]) -> SamplingParams:
        """`params` with the checkpoint's value for each field in `unset` that it gives."""
        changes = {name: value for name, value in self.values.items() if name in set(unset)}
        return replace(params, **changes) if changes else params

    def describe(self) -> str:
        """One line for the ready block: `temperature 0.6, top_k 20 (generation_config.json)`."""
        return ", ".join(f"{k} {v:g}" for k, v in self.values.items()) + f" ({self.source})"


def read_sampling_defaults(
    *, metadata: Mapping[str, object] | None = None, directory: Path | None = None
) -> SamplingDefaults:
    """The defaults of a GGUF file's metadata, or of a model directory's `generation_config.json`."""
    if metadata is not None:
        raw = {name: metadata[key] for key, name in _GGUF_KEYS.items() if key in metadata}
        return _checked(raw, "GGUF metadata")
    if directory is None:
        return SamplingDefaults()
    path = directory / "generation_config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return SamplingDefaults()
    if not isinstance(config, dict):
        return SamplingDefaults()
    return _checked({name: config[name] for name in FIELDS if name in config}, "generation_config.json")


def checkpoint_sampling_defaults(source: ModelSource, metadata: Mapping[str, object] | None = None) -> SamplingDefaults:
    """The defaults of the checkpoint `source` names: a GGUF's metadata (`metadata` when already
    read, else read from the file) or a model directory's `generation_config.json`."""
    if source.kind == "gguf":
        return read_sampling_defaults(metadata=metadata if metadata is not None else open_gguf(source.path).metadata)
    return read_sampling_defaults(directory=source.path)


def _checked(raw: Mapping[str, object], source: str) -> SamplingDefaults:
    values: dict[str, float | int] = {}
    for name in FIELDS:
        value = raw.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            log.warning("%s: %s = %r is not a number; left out of the sampling defaults", source, name, value)
            continue
        value = int(value) if name == "top_k" else float(value)
        try:
            replace(SamplingParams(), **{name: value}).validate()
        except ValueError as err:
            log.warning("%s: %s; left out of the sampling defaults", source, err)
            continue
        values[name] = value
    return SamplingDefaults(values, source if values else "")
