"""Which tool-call format a model uses: the parsers by name and the choice from the model.

Owns `TOOL_PARSERS` (the names `--tool-call-parser` accepts), `make_tool_parser` and
`detect_tool_parser`, which reads the chat template and vocabulary first (a ChatML template is
Hermes even on a Llama architecture, as SmolLM2 is) and the model family's `tool_parser`
(families/) second. No parsing here.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from freetoken.errors import ConfigError
from freetoken.families import named
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
    ("<|channel|>", HarmonyParser.name),
    ("<|tool_call>", Gemma4Parser.name),
    ("<|turn>", Gemma4Parser.name),
    ("[TOOL_CALLS]", MistralParser.name),
    ("<arg_key>", Glm45Parser.name),
    ("<parameter=", Qwen3CoderParser.name),
    ("<tool_call>", HermesParser.name),
    ("<|im_start|>", HermesParser.name),
    ("<start_of_turn>", GemmaParser.name),
    ("<|python_tag|>", Llama3JsonParser.name),
    ("<|eot_id|>", Llama3JsonParser.name),
)
DEFAULT_PARSER = HermesParser.name


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
    """The parser name for a model: template markers, then special tokens, then the family's
    `tool_parser` (`architecture`: any name the family goes by, families/), then Hermes."""
    template = chat_template or ""
    for marker, name in _MARKERS:
        if marker in template:
            return name
    vocab = set(special_tokens)
    for marker, name in _MARKERS:
        if marker in vocab:
            return name
    fam = named(architecture) if architecture else None
    return fam.tool_parser if fam is not None and fam.tool_parser is not None else DEFAULT_PARSER
