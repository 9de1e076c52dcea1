"""Mistral (dense): what the layers below the models know of it (the model is `models/mistral.py`).

Safetensors only: llama.cpp writes Mistral GGUFs as `llama`, which load through the Llama family.
A `config.json` without `max_position_embeddings` means MistralConfig's 131072 tokens; its
`sliding_window` (Mistral 7B v0.1: 4096, later versions null) makes every layer slide.
"""

from __future__ import annotations

from freetoken.families.base import Family, HFFacts

FAMILY = Family(
    name="mistral",
    model_types=("mistral",),
    hf=HFFacts(default_context=131_072, default_window=None),
    tool_parser="mistral",
)
