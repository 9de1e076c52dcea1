"""`ft serve`'s configuration checks that need only the model's metadata, run in the API process
before the engine process starts (so a refusal costs no model load).

Owns `ModelFacts` (context length and sliding window, read from the GGUF key/value section or
`config.json` -- never a tensor) and `preflight`, which resolves the `EngineConfig` against those
facts. Pool sizes that depend on free memory are taken at their largest (`by_need`: every running
request at full context), so what preflight refuses the engine would refuse too; what passes here
can still be refused by the engine against the real memory (then the supervisor gives up and
`ft serve` exits 1). It imports no torch: the families' rules for which layers slide are restated
here in their simplest form (gemma3 and gpt-oss have sliding-window layers, llama has none).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass

from freetoken.config import EngineConfig, ResolvedConfig
from freetoken.errors import ModelLoadError
from freetoken.weights.source import ModelSource

log = logging.getLogger("freetoken.server")

# GGUF general.architecture / HF model_type -> (default context, default window or None)
_GGUF_SWA = {"gemma3", "gpt-oss"}
_HF_DEFAULTS: dict[str, tuple[int, int | None]] = {
    "llama": (2048, None),
    "gemma3_text": (131_072, 4096),
    "gpt_oss": (131_072, 128),
    "qwen2": (32_768, None),
    "qwen3": (32_768, None),
    "qwen3_moe": (32_768, None),
    "mistral": (131_072, None),
}
# Families whose `sliding_window` is only used when `use_sliding_window` is true (Qwen2/3 write a
# window into every config.json, usually with the switch off).
_SWITCHED_WINDOW = {"qwen2", "qwen3", "qwen3_moe"}


@dataclass(frozen=True)
class ModelFacts:
    context_length: int
    window: int | None  # None: no sliding-window layers


def facts_from_gguf(metadata: Mapping[str, object]) -> ModelFacts:
    arch = metadata.get("general.architecture")
    context = metadata.get(f"{arch}.context_length")
    if not isinstance(arch, str) or not isinstance(context, int):
        raise ModelLoadError("GGUF metadata lacks general.architecture or its context_length")
    window = metadata.get(f"{arch}.attention.sliding_window") if arch in _GGUF_SWA else None
    return ModelFacts(context, int(window) if isinstance(window, int) else None)


def facts_from_hf(config: Mapping[str, object]) -> ModelFacts:
    model_type = config.get("model_type")
    if model_type == "gemma3" and isinstance(config.get("text_config"), Mapping):
        config, model_type = config["text_config"], "gemma3_text"  # type: ignore[assignment]
    if not isinstance(model_type, str) or model_type not in _HF_DEFAULTS:
        raise ModelLoadError(f"unsupported model_type {model_type!r}")
    default_context, default_window = _HF_DEFAULTS[model_type]
    context = config.get("max_position_embeddings") or default_context
    window = config.get("sliding_window") or default_window
    if model_type in _SWITCHED_WINDOW and not config.get("use_sliding_window"):
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
