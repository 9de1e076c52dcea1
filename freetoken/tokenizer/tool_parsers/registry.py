"""Which tool-call format a model uses: the parsers by name and the choice from the model.

Owns `TOOL_PARSERS` (the names `--tool-call-parser` accepts), `make_tool_parser` and
`detect_tool_parser`, which reads the chat template and vocabulary first (a ChatML template is
Hermes even on a Llama architecture, as SmolLM2 is) and the architecture second. No parsing here.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from freetoken.errors import ConfigError
from freetoken.tokenizer.tool_parsers.base import ToolParser
from freetoken.tokenizer.tool_parsers.gemma import GemmaParser
from freetoken.tokenizer.tool_parsers.gemma4 import Gemma4Parser
from freetoken.tokenizer.tool_parsers.glm45 import Glm45Parser
from freetoken.tokenizer.tool_parsers.harmony import HarmonyParser
from freetoken.tokenizer.tool_parsers.hermes import HermesParser
from freetoken.tokenizer.tool_parsers.llama3_json import Llama3JsonParser
from freetoken.tokenizer.tool_parsers.mistral import MistralParser
from freetoken.tokenizer.tool_parsers.qwen3_coder import Qwen3CoderParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    cls.name: cls
    for cls in (
        HermesParser,
        GemmaParser,
        Gemma4Parser,
        Llama3JsonParser,
        HarmonyParser,
        Qwen3CoderParser,
        Glm45Parser,
        MistralParser,
    )
}

# (marker in the template or vocabulary, parser), first match wins: the formats that also write
# `<tool_call>` (Qwen3-Coder / Qwen3.5's `<parameter=`, GLM's `<arg_key>`) come before Hermes.
_MARKERS = (
    ("<|channel|>", "harmony"),
    ("<|tool_call>", "gemma4"),
    ("<|turn>", "gemma4"),
    ("[TOOL_CALLS]", "mistral"),
    ("<arg_key>", "glm45"),
    ("<parameter=", "qwen3_coder"),
    ("<tool_call>", "hermes"),
    ("<|im_start|>", "hermes"),
    ("<start_of_turn>", "gemma"),
    ("<|python_tag|>", "llama3_json"),
    ("<|eot_id|>", "llama3_json"),
)
_ARCHITECTURES = {
    "gpt_oss": "harmony",
    "gpt-oss": "harmony",
    "gemma": "gemma",
    "gemma2": "gemma",
    "gemma3": "gemma",
    "gemma3_text": "gemma",
    "gemma4": "gemma4",
    "gemma4_text": "gemma4",
    "llama": "llama3_json",
    "glm4_moe": "glm45",
    "mistral": "mistral",
    "mistral3": "mistral",
    "qwen2": "hermes",
    "qwen3": "hermes",
}
DEFAULT_PARSER = "hermes"


def make_tool_parser(
    name: str,
    tool_names: Iterable[str] | None = None,
    *,
    schemas: Mapping[str, Mapping[str, Any]] | None = None,
    marker_tokens: Mapping[str, int] | None = None,
) -> ToolParser:
    """The parser called `name` (see `ToolParser` for the arguments); ConfigError for an unknown one."""
    cls = TOOL_PARSERS.get(name)
    if cls is None:
        raise ConfigError(f"unknown tool-call parser {name!r}; choose one of {', '.join(TOOL_PARSERS)}")
    return cls(tool_names, schemas=schemas, marker_tokens=marker_tokens)


def detect_tool_parser(*, chat_template: str | None, special_tokens: Iterable[str], architecture: str | None) -> str:
    """The parser name for a model: template markers, then special tokens, then architecture."""
    template = chat_template or ""
    for marker, name in _MARKERS:
        if marker in template:
            return name
    vocab = set(special_tokens)
    for marker, name in _MARKERS:
        if marker in vocab:
            return name
    return _ARCHITECTURES.get(architecture or "", DEFAULT_PARSER)
