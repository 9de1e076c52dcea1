"""Reading a checkpoint found by `weights.source`: HF config dict and HF-named tensors.

Owns turning a ModelSource into tensors; building the model and the tokenizer is the caller's
business.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from freetoken.errors import ModelLoadError
from freetoken.ops.quantized import QuantizedWeight
from freetoken.weights.progress import ProgressCallback
from freetoken.weights.safetensors import load_safetensors_dir, shard_files
from freetoken.weights.source import DEFAULT_MODEL, SHORT_NAMES, ModelSource, resolve_model


@dataclass
class Checkpoint:
    """A checkpoint read into memory: HF config dict and HF-named tensors."""

    source: ModelSource
    hf_config: dict[str, object]
    tensors: dict[str, torch.Tensor | QuantizedWeight]  # quantized only from GGUF with keep_quantized
    metadata: dict[str, object] | None = None  # GGUF key/values (tokenizer, template); None for safetensors
    quant_types: dict[str, int] = field(default_factory=dict)


def read_hf_config(directory: Path) -> dict[str, object]:
    try:
        config = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError) as err:
        raise ModelLoadError(f"{directory / 'config.json'} is not valid JSON ({err})") from None
    if not isinstance(config, dict):
        raise ModelLoadError(f"{directory / 'config.json'} is not a JSON object")
    return config


def load_checkpoint(
    source: ModelSource, dtype: torch.dtype, keep_quantized: bool = False, progress: ProgressCallback | None = None
) -> Checkpoint:
    """Read the checkpoint's config and tensors (for GGUF: dequantized to `dtype`, or with
    `keep_quantized` the integer-typed matrices as QuantizedWeights); `progress` after each tensor."""
    if source.kind == "safetensors":
        return Checkpoint(source, read_hf_config(source.path), load_safetensors_dir(source.path, dtype, progress))
    from freetoken.weights.gguf import load_gguf

    ckpt = load_gguf(source.path, dtype=dtype, keep_quantized=keep_quantized, progress=progress)
    return Checkpoint(source, ckpt.hf_config, ckpt.tensors, ckpt.metadata, ckpt.quant_types)


def read_header(source: ModelSource) -> Checkpoint:
    """The checkpoint's config (and GGUF metadata and quant types) without its tensors."""
    if source.kind == "safetensors":
        return Checkpoint(source, read_hf_config(source.path), {})
    from freetoken.weights.gguf import read_gguf_header

    header = read_gguf_header(source.path)
    return Checkpoint(source, header.hf_config, {}, header.metadata, header.quant_types)


def checkpoint_files(source: ModelSource) -> list[Path]:
    """The files a load reads: the GGUF file, or a directory's config and safetensors files."""
    if source.kind == "gguf":
        return [Path(source.path)]
    return [Path(source.path) / "config.json", *shard_files(source.path)]


__all__ = [
    "DEFAULT_MODEL",
    "SHORT_NAMES",
    "Checkpoint",
    "ModelSource",
    "checkpoint_files",
    "load_checkpoint",
    "read_header",
    "read_hf_config",
    "resolve_model",
]
