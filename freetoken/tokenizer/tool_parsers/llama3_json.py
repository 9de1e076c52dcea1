"""Llama 3.x JSON tool calls: the output is `{"name": ..., "parameters": {...}}`, possibly after
`<|python_tag|>`, several calls separated by `;` or given as a list.

Owns that format: the built-in prompt (for Llama 3 templates that render no tools), the rendering
of earlier calls and the parser. An output that opens with anything but JSON or the python tag
is plain text; `<|python_tag|>` later in the text starts a call that runs to the end. Calls whose
object names a known tool before its arguments stream them while they are written, one after the
other; a list of calls is parsed whole.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from freetoken.tokenizer.tool_parsers.base import ToolCall, ToolCallStream, ToolParser, tools_json
from freetoken.tokenizer.tool_parsers.blocks import BlockMarker, BlockStream, call_head
from freetoken.tokenizer.tool_parsers.grammar import call_schema, forced_call_grammar
from freetoken.tokenizer.tool_parsers.json_values import calls_from_values, json_values

PYTHON_TAG = "<|python_tag|>"
ARG_KEYS = ("parameters", "arguments")


class Llama3JsonParser(ToolParser):
    name = "llama3_json"

    def stream(self) -> ToolCallStream:
        return BlockStream(
            [BlockMarker(PYTHON_TAG, None, self._head)],
            self._parse_block,
            bare_json_at_start=True,
            bare_head=self._head,
        )

    def _head(self, body: str) -> tuple[str, int] | Literal[False] | None:
        return call_head(body, ARG_KEYS, self.tool_names)

    def _parse_block(self, body: str) -> list[ToolCall] | None:
        return calls_from_values(json_values(body, separators=";"), self.tool_names)

    def tool_prompt(self, tools: Sequence[Mapping[str, Any]], *, parallel: bool) -> str:
        several = " For several calls, separate the objects with ';'." if parallel else ""
        return (
            "You can call the functions below (JSON schemas):\n"
            f"{tools_json(tools)}\n\n"
            "To call a function, reply with only a JSON object of the form "
            '{"name": "<function name>", "parameters": {<arguments as a JSON object>}}.' + several
        )

    def forced_grammar(self, tools: Sequence[Mapping[str, Any]]) -> str:
        return forced_call_grammar("", call_schema(tools, "parameters"), "")

    def format_calls(self, calls: Sequence[ToolCall]) -> str:
        return "; ".join(f'{{"name": {json.dumps(c.name)}, "parameters": {c.arguments}}}' for c in calls)
