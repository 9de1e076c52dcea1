"""Choosing the model class for a configuration.

Owns the map from `ModelConfig.architecture` to a family's module and the protocol every family
implements. It does not load weights from files (the weights package does that).
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Protocol

import torch

from freetoken.attention.metadata import ForwardBatch
from freetoken.errors import ModelLoadError
from freetoken.kv.tensors import KVTensors
from freetoken.models.config import ModelConfig
from freetoken.models.gemma3 import Gemma3ForCausalLM
from freetoken.models.gemma4 import Gemma4ForCausalLM
from freetoken.models.gpt_oss import GptOssForCausalLM
from freetoken.models.linear import Weight
from freetoken.models.llama import LlamaForCausalLM
from freetoken.models.qwen3 import Qwen3ForCausalLM
from freetoken.models.qwen3_moe import Qwen3MoeForCausalLM


class CausalLM(Protocol):
    config: ModelConfig

    def load_weights(self, tensors: MutableMapping[str, Weight], weights: str = "auto", prefill_weights: str = "quantized") -> None:
        """Copy HF-named tensors into the model under the `--weights` policy (and with a dense
        prefill copy of each quantized linear layer); ModelLoadError names missing/unexpected ones."""

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch, kv: KVTensors) -> torch.Tensor:
        """input_ids [T] -> logits [N, vocab] (float32, float64 for a float64 model)."""

    def __call__(self, input_ids: torch.Tensor, batch: ForwardBatch, kv: KVTensors) -> torch.Tensor: ...


def build_model(config: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> CausalLM:
    """An uninitialised model of the config's family (call load_weights next)."""
    if config.architecture == "llama":
        return LlamaForCausalLM(config, dtype, device)
    if config.architecture == "gemma3":
        return Gemma3ForCausalLM(config, dtype, device)
    if config.architecture == "gpt_oss":
        return GptOssForCausalLM(config, dtype, device)
    if config.architecture == "qwen3":
        return Qwen3ForCausalLM(config, dtype, device)
    if config.architecture == "qwen3_moe":
        return Qwen3MoeForCausalLM(config, dtype, device)
    if config.architecture == "gemma4":
        return Gemma4ForCausalLM(config, dtype, device)
    raise ModelLoadError(f"unsupported architecture {config.architecture!r}")
