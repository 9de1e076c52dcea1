"""Gemma tool calls: a fenced code block tagged `tool_call` holding `{"name": ..., "parameters": ...}`.

Gemma 3 has no tool tokens and its template renders no tools, so this format is the one our
built-in Gemma tool prompt asks for:

    ```tool_call
    {"name": "get_weather", "parameters": {"city": "Paris"}}
    ```

The parser also takes a block tagged `json` holding a call, a list of calls in one block, and an
output that is a bare call object (`{"name": ...}` as its first non-blank text); `arguments` is
read like `parameters`. A call object that names a known tool before its arguments streams them
while they are written (as the forced-call grammar writes it); a list of calls is parsed whole.
Results go back as ```` ```tool_output ```` blocks in a user turn.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from freetoken.tokenizer.tool_parsers.base import ToolCall, ToolCallStream, ToolParser, tools_json
from freetoken.tokenizer.tool_parsers.blocks import BlockMarker, BlockStream, call_head
from freetoken.tokenizer.tool_parsers.grammar import call_schema, forced_call_grammar
from freetoken.tokenizer.tool_parsers.json_values import calls_from_values, json_values

FENCE = "```"
ARG_KEYS = ("parameters", "arguments")


class GemmaParser(ToolParser):
    name = "gemma"

    def stream(self) -> ToolCallStream:
        markers = (BlockMarker("```tool_call", FENCE, self._head), BlockMarker("```json", FENCE, self._head))
        return BlockStream(markers, self._parse_block, bare_json_at_start=True, bare_head=self._head)

    def _head(self, body: str) -> tuple[str, int] | Literal[False] | None:
        return call_head(body, ARG_KEYS, self.tool_names)

    def _parse_block(self, body: str) -> list[ToolCall] | None:
        return calls_from_values(json_values(body), self.tool_names)

    def tool_prompt(self, tools: Sequence[Mapping[str, Any]], *, parallel: bool) -> str:
        how_many = "You may call several functions, one block each." if parallel else "Call at most one function."
        return (
            "You have access to the functions below, described as JSON schemas:\n"
            f"{tools_json(tools)}\n\n"
            "To call a function, answer with a code block tagged tool_call that holds a JSON object with the "
            'function\'s "name" and its "parameters", and nothing else:\n'
            '```tool_call\n{"name": "<function name>", "parameters": {<arguments as a JSON object>}}\n```\n'
            f"{how_many} The results come back in a tool_output code block."
        )

    def forced_grammar(self, tools: Sequence[Mapping[str, Any]]) -> str:
        return forced_call_grammar("```tool_call\n", call_schema(tools, "parameters"), "\n```")

    def format_calls(self, calls: Sequence[ToolCall]) -> str:
        return "\n".join(
            f'```tool_call\n{{"name": {json.dumps(c.name)}, "parameters": {c.arguments}}}\n```' for c in calls
        )

    def format_result(self, content: str, name: str | None) -> str:
        return f"```tool_output\n{content}\n```"
