"""Choosing a family: the config reader for a `config.json`, the model class for a configuration.

Owns the map from `ModelConfig.architecture` to the family's reader of its `config.json`
(`config_from_hf`, in each family's module) and its model class, the map from a `config.json`'s
`model_type` to the reader (the model_types are the family's facts, `freetoken.families`), and
the protocol every family implements. It does not load weights from files (the weights package
does that).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, MutableMapping
from typing import Any, Protocol

import torch

from freetoken.attention.metadata import ForwardBatch
from freetoken.errors import ModelLoadError
from freetoken.families import family
from freetoken.kv.tensors import KVTensors
from freetoken.models import gemma3, gemma4, glm4_moe, gpt_oss, llama, mistral, qwen2, qwen3, qwen3_5, qwen3_moe
from freetoken.models.config import ModelConfig
from freetoken.models.linear import Weight

# Each family's reader of its `config.json` (a multimodal checkpoint's reader reads its
# `text_config`) and its model class, by `ModelConfig.architecture`; which `model_type`s a reader
# reads is the family's (`freetoken.families`). Qwen2 and Mistral are Llama's tree with other
# biases / windows.
MODELS: dict[str, tuple[Callable[[Mapping[str, Any]], ModelConfig], Callable[..., CausalLM]]] = {
    "llama": (llama.config_from_hf, llama.LlamaForCausalLM),
    "gemma3": (gemma3.config_from_hf, gemma3.Gemma3ForCausalLM),
    "gpt_oss": (gpt_oss.config_from_hf, gpt_oss.GptOssForCausalLM),
    "qwen3": (qwen3.config_from_hf, qwen3.Qwen3ForCausalLM),
    "qwen3_moe": (qwen3_moe.config_from_hf, qwen3_moe.Qwen3MoeForCausalLM),
    "gemma4": (gemma4.config_from_hf, gemma4.Gemma4ForCausalLM),
    "qwen2": (qwen2.config_from_hf, llama.LlamaForCausalLM),
    "mistral": (mistral.config_from_hf, llama.LlamaForCausalLM),
    "qwen3_5": (qwen3_5.config_from_hf, qwen3_5.Qwen3_5ForCausalLM),
    "qwen3_5_moe": (qwen3_5.config_from_hf, qwen3_5.Qwen3_5ForCausalLM),
    "qwen3_next": (qwen3_5.config_from_hf, qwen3_5.Qwen3_5ForCausalLM),
    "glm4_moe": (glm4_moe.config_from_hf, glm4_moe.Glm4MoeForCausalLM),
}


# The reader of each `model_type` transformers writes.
def _model_types(name: str) -> tuple[str, ...]:
    fam = family(name)
    if fam is None:
        raise RuntimeError(f"models/registry.py names {name!r}, which no module of freetoken/families/ describes")
    return fam.model_types


CONFIG_READERS: dict[str, Callable[[Mapping[str, Any]], ModelConfig]] = {
    model_type: reader for name, (reader, _) in MODELS.items() for model_type in _model_types(name)
}


def config_from_hf(config: Mapping[str, Any]) -> ModelConfig:
    """Read a Hugging Face `config.json` dict with its family's reader; ModelLoadError for a
    `model_type` no family reads."""
    model_type = config.get("model_type")
    reader = CONFIG_READERS.get(model_type) if isinstance(model_type, str) else None
    if reader is None:
        raise ModelLoadError(f"unsupported model_type {model_type!r} (supported: {', '.join(CONFIG_READERS)})")
    return reader(config)


class CausalLM(Protocol):
    config: ModelConfig

    def load_weights(
        self, tensors: MutableMapping[str, Weight], weights: str = "auto", prefill_weights: str = "quantized"
    ) -> None:
        """Copy HF-named tensors into the model under the `--weights` policy (and with a dense
        prefill copy of each quantized linear layer); ModelLoadError names missing/unexpected ones."""

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch, kv: KVTensors) -> torch.Tensor:
        """input_ids [T] -> logits [N, vocab] (float32, float64 for a float64 model)."""

    def __call__(self, input_ids: torch.Tensor, batch: ForwardBatch, kv: KVTensors) -> torch.Tensor: ...


def build_model(config: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> CausalLM:
    """An uninitialised model of the config's family (call load_weights next)."""
    entry = MODELS.get(config.architecture)
    if entry is None:
        raise ModelLoadError(f"unsupported architecture {config.architecture!r}")
    return entry[1](config, dtype, device)
