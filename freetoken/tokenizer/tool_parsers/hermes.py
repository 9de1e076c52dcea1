"""Hermes / Qwen-style tool calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.

Owns that format (used by Qwen 2.5+, Hermes models, SmolLM2 and the tiny ChatML test models):
its built-in tool prompt, the rendering of earlier calls, and the parser, whose calls stream their
arguments while they are written when the object names the tool first (as the forced-call
grammar writes it). Results go back in
`<tool_response>` blocks. Nothing else here.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from freetoken.tokenizer.tool_parsers.base import ToolCall, ToolCallStream, ToolParser, tools_json
from freetoken.tokenizer.tool_parsers.blocks import BlockMarker, BlockStream, object_head
from freetoken.tokenizer.tool_parsers.grammar import call_schema, forced_call_grammar
from freetoken.tokenizer.tool_parsers.json_values import calls_from_values, json_values

START, END = "<tool_call>", "</tool_call>"


class HermesParser(ToolParser):
    name = "hermes"
    markers = (START, END)  # added tokens in Qwen's vocabularies

    def stream(self) -> ToolCallStream:
        return BlockStream([BlockMarker(START, END, self._head)], self._parse_block, bare_json_at_start=False)

    def _head(self, body: str) -> tuple[str, int] | Literal[False] | None:
        return object_head(body, ("name", "arguments"), self.tool_names)

    def _parse_block(self, body: str) -> list[ToolCall] | None:
        return calls_from_values(json_values(body), self.tool_names)

    def tool_prompt(self, tools: Sequence[Mapping[str, Any]], *, parallel: bool) -> str:
        how_many = "one or more functions" if parallel else "at most one function"
        return (
            "# Tools\n\n"
            f"You can call {how_many} to help answer. The function signatures, as JSON schemas, are listed "
            f"between <tools> and </tools>:\n<tools>\n{tools_json(tools)}\n</tools>\n\n"
            "To call a function, write a JSON object with its name and arguments between <tool_call> and "
            "</tool_call> tags, one block per call:\n"
            '<tool_call>\n{"name": "<function name>", "arguments": {<arguments as a JSON object>}}\n</tool_call>'
        )

    def forced_grammar(self, tools: Sequence[Mapping[str, Any]]) -> str:
        return forced_call_grammar(START + "\n", call_schema(tools, "arguments"), "\n" + END, self.marker_tokens)

    def format_calls(self, calls: Sequence[ToolCall]) -> str:
        return "\n".join(f'{START}\n{{"name": {json.dumps(c.name)}, "arguments": {c.arguments}}}\n{END}' for c in calls)
