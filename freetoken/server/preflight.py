"""`ft serve`'s configuration checks that need only the model's metadata, run in the API process
before the engine process starts (so a refusal costs no model load).

Owns `ModelFacts` (context length and sliding window, read from the GGUF key/value section or
`config.json` -- never a tensor) and `preflight`, which resolves the `EngineConfig` against those
facts. Pool sizes that depend on free memory are taken at their largest (`by_need`: every running
request at full context), so what preflight refuses the engine would refuse too; what passes here
can still be refused by the engine against the real memory (then the supervisor gives up and
`ft serve` exits 1). It imports no torch: what it knows of a family (the default context and
window of its `config.json`, whether its GGUF files carry a window) is the family's torch-free
facts (`freetoken.families`), read here in their simplest form; it holds no family itself.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass

from freetoken.config import EngineConfig, ResolvedConfig
from freetoken.errors import ModelLoadError
from freetoken.families import by_model_type, find_gguf
from freetoken.weights.source import ModelSource

log = logging.getLogger("freetoken.server")


@dataclass(frozen=True)
class ModelFacts:
    context_length: int
    window: int | None  # None: no sliding-window layers


def facts_from_gguf(metadata: Mapping[str, object]) -> ModelFacts:
    arch = metadata.get("general.architecture")
    context = metadata.get(f"{arch}.context_length")
    if not isinstance(arch, str) or not isinstance(context, int):
        raise ModelLoadError("GGUF metadata lacks general.architecture or its context_length")
    gguf = find_gguf(arch)  # an architecture no family runs is refused at load, not here
    window = metadata.get(f"{arch}.attention.sliding_window") if gguf is not None and gguf.window else None
    return ModelFacts(context, int(window) if isinstance(window, int) else None)


def facts_from_hf(config: Mapping[str, object]) -> ModelFacts:
    model_type = config.get("model_type")
    family = by_model_type(model_type) if isinstance(model_type, str) else None
    facts = None if family is None else family.hf
    if facts is not None and facts.nested == model_type:  # the text model's config is `text_config`
        text = config.get("text_config")
        if not isinstance(text, Mapping):
            raise ModelLoadError(f"unsupported model_type {model_type!r}")
        config = text
    if facts is None:
        raise ModelLoadError(f"unsupported model_type {model_type!r}")
    context = config.get("max_position_embeddings") or facts.default_context
    window = config.get("sliding_window") or facts.default_window
    if facts.switched_window and not config.get("use_sliding_window"):
        window = None
    layer_types = config.get("layer_types")
    if isinstance(layer_types, list) and "sliding_attention" not in layer_types:
        window = None
    return ModelFacts(int(context), None if window is None else int(window))  # type: ignore[call-overload]


def model_facts(source: ModelSource, gguf_metadata: Mapping[str, object] | None) -> ModelFacts:
    if source.kind == "gguf":
        if gguf_metadata is None:
            raise ValueError("a GGUF source needs its metadata")
        return facts_from_gguf(gguf_metadata)
    try:
        config = json.loads((source.path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ModelLoadError(f"cannot read {source.path / 'config.json'} ({err})") from None
    return facts_from_hf(config)


def preflight(config: EngineConfig, facts: ModelFacts) -> ResolvedConfig:
    """Resolve `config` for the model as far as metadata allows; ConfigError names the flag."""
    if config.context_length is not None and config.context_length > facts.context_length:
        log.warning(
            "--context-length %d is above the model's %d: using %d",
            config.context_length,
            facts.context_length,
            facts.context_length,
        )
    # kv_bytes_per_token 1 with unbounded memory: the FULL pool at its largest (by_need).
    return config.resolve(
        model_context_length=facts.context_length, window=facts.window, kv_bytes_per_token=1, available_bytes=2**62
    )
