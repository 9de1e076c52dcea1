"""Choosing a family: the config reader for a `config.json`, the model class for a configuration.

Owns the map from a `config.json`'s `model_type` to its family's reader (`config_from_hf`, in
each family's module), the map from `ModelConfig.architecture` to the family's model class, and
the protocol every family implements. It does not load weights from files (the weights package
does that).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, MutableMapping
from typing import Any, Protocol

import torch

from freetoken.attention.metadata import ForwardBatch
from freetoken.errors import ModelLoadError
from freetoken.kv.tensors import KVTensors
from freetoken.models import gemma3, gemma4, gpt_oss, llama, mistral, qwen2, qwen3, qwen3_5, qwen3_moe
from freetoken.models.config import ModelConfig
from freetoken.models.linear import Weight

# The reader of each `model_type` transformers writes (a multimodal checkpoint's reader reads its
# `text_config`).
CONFIG_READERS: dict[str, Callable[[Mapping[str, Any]], ModelConfig]] = {
    "llama": llama.config_from_hf,
    "gemma3": gemma3.config_from_hf,
    "gemma3_text": gemma3.config_from_hf,
    "gpt_oss": gpt_oss.config_from_hf,
    "qwen3": qwen3.config_from_hf,
    "qwen3_moe": qwen3_moe.config_from_hf,
    "gemma4": gemma4.config_from_hf,
    "gemma4_text": gemma4.config_from_hf,
    "qwen2": qwen2.config_from_hf,
    "mistral": mistral.config_from_hf,
    "qwen3_5": qwen3_5.config_from_hf,
    "qwen3_5_text": qwen3_5.config_from_hf,
    "qwen3_5_moe": qwen3_5.config_from_hf,
    "qwen3_5_moe_text": qwen3_5.config_from_hf,
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
    if config.architecture in ("llama", "qwen2", "mistral"):  # the latter two: Llama's tree, other biases / windows
        return llama.LlamaForCausalLM(config, dtype, device)
    if config.architecture == "gemma3":
        return gemma3.Gemma3ForCausalLM(config, dtype, device)
    if config.architecture == "gpt_oss":
        return gpt_oss.GptOssForCausalLM(config, dtype, device)
    if config.architecture == "qwen3":
        return qwen3.Qwen3ForCausalLM(config, dtype, device)
    if config.architecture == "qwen3_moe":
        return qwen3_moe.Qwen3MoeForCausalLM(config, dtype, device)
    if config.architecture == "gemma4":
        return gemma4.Gemma4ForCausalLM(config, dtype, device)
    if config.architecture in ("qwen3_5", "qwen3_5_moe"):
        return qwen3_5.Qwen3_5ForCausalLM(config, dtype, device)
    raise ModelLoadError(f"unsupported architecture {config.architecture!r}")
