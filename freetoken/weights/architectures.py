"""Which GGUF architectures FreeToken runs: the list and its check, free of torch.

Owns only the names. `names.py` (tensor renaming, needs torch) and `gguf_config.py` (metadata to
an HF config, imported by the API process, which must stay torch-free) both read it here.
"""

from __future__ import annotations

from freetoken.errors import ModelLoadError

SUPPORTED_ARCHITECTURES: tuple[str, ...] = (
    "llama",
    "gemma3",
    "gpt-oss",
    "qwen3",
    "qwen3moe",
    "gemma4",
    "qwen2",
    "qwen35",
    "qwen35moe",
)


def check_architecture(arch: str) -> None:
    """Raise ModelLoadError naming `arch` unless FreeToken runs it."""
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(f"unsupported architecture: {arch}")
