"""Tool calling in Anthropic's shapes, for `/v1/messages`: the same machinery as the OpenAI route.

Owns `anthropic_tool_options` (Anthropic `tools` = `{name, description, input_schema}` and
`tool_choice` = `auto | any | tool | none`, with `disable_parallel_tool_use`, validated into
`ToolOptions`), `anthropic_content` (a parsed output as `thinking` + `text` + `tool_use` blocks
and its `stop_reason`) and `AnthropicBlockStream` (stream deltas as `content_block_start` /
`content_block_delta` (`thinking_delta`, `text_delta`, `input_json_delta` while a call's
arguments are written) / `content_block_stop` events, block indices in order). The route module frames the events; nothing here touches the engine.
"""

from __future__ import annotations

import json
from typing import Any

from freetoken.server.core.tool_calling import ToolOptions, openai_tool_options
from freetoken.server.errors import APIError, bad_request
from freetoken.tokenizer.tool_parsers import ParsedOutput, StreamDelta, ToolCall

Event = tuple[str, dict[str, Any]]  # (event name, data)


def anthropic_tool_options(tools: list[dict[str, Any]] | None, tool_choice: dict[str, Any] | None) -> ToolOptions:
    """Validate Anthropic `tools` / `tool_choice` (a 400 naming the field) into ToolOptions."""
    converted = []
    for k, tool in enumerate(tools or ()):
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
            raise bad_request(f"tools[{k}] must be an object with a name and an input_schema", param=f"tools[{k}]")
        if tool.get("type") not in (None, "custom"):
            raise bad_request(
                f"tools[{k}]: server tools of type {tool.get('type')!r} are not supported", param=f"tools[{k}].type"
            )
        fn = {"name": tool["name"], "parameters": tool.get("input_schema")}
        if tool.get("description") is not None:
            fn["description"] = tool["description"]
        converted.append({"type": "function", "function": fn})
    choice: Any = None
    parallel = True
    if tool_choice is not None:
        kind = tool_choice.get("type")
        disable = tool_choice.get("disable_parallel_tool_use", False)
        if not isinstance(disable, bool):
            raise bad_request(
                "tool_choice.disable_parallel_tool_use must be a boolean", param="tool_choice.disable_parallel_tool_use"
            )
        parallel = not disable
        if kind == "tool":
            choice = {"type": "function", "function": {"name": tool_choice.get("name")}}
        elif kind in ("auto", "none", "any"):
            choice = "required" if kind == "any" else kind
        else:
            raise bad_request('tool_choice.type must be "auto", "any", "tool" or "none"', param="tool_choice.type")
    try:
        return openai_tool_options(converted or None, choice, parallel)
    except APIError as err:  # the OpenAI field names, put in Anthropic's terms
        message = err.message.replace("function.parameters", "input_schema").replace(".function", "")
        param = (
            None
            if err.param is None
            else err.param.replace(".function.parameters", ".input_schema").replace(".function", "")
        )
        raise bad_request(message, param=param) from None


def tool_use_id(call: ToolCall) -> str:
    return "toolu_" + call.id.removeprefix("call_")


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's `input`: its arguments object; a call cut off by max_tokens (arguments that do not
    parse) has an empty one."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def tool_use_block(call: ToolCall) -> dict[str, Any]:
    return {"type": "tool_use", "id": tool_use_id(call), "name": call.name, "input": tool_input(call.arguments)}


def thinking_block(text: str) -> dict[str, Any]:
    """Reasoning as a `thinking` block; there is no signature to give (replayed blocks are
    taken back with any or none)."""
    return {"type": "thinking", "thinking": text, "signature": ""}


def anthropic_content(
    out: ParsedOutput, *, thinking: bool | None = False, omit_thinking: bool = False
) -> list[dict[str, Any]]:
    """A message's `content` blocks: the reasoning first when the request asked to think (empty
    with `display: "omitted"`), the text (if any, or when there is nothing else), then one
    `tool_use` block per call."""
    blocks: list[dict[str, Any]] = []
    if thinking and out.reasoning:
        blocks.append(thinking_block("" if omit_thinking else out.reasoning))
    if out.content or not out.tool_calls:
        blocks.append({"type": "text", "text": out.content})
    blocks += [tool_use_block(c) for c in out.tool_calls]
    return blocks


def tool_stop_reason(reason: str, num_calls: int) -> str:
    """`tool_use` replaces `end_turn` when the output held calls; a call cut off stays `max_tokens`."""
    return "tool_use" if num_calls and reason == "end_turn" else reason


class AnthropicBlockStream:
    """Content-block events of one streamed message, indices from 0 in order. A block opens when
    its kind of output arrives and closes when another kind does (or at the end): `thinking`
    (reasoning, when the request asked to think), `text`, and one `tool_use` block per call, whose
    arguments go out as `input_json_delta`s while the model writes them. Like the non-streamed
    body, an output with no block is one empty text block."""

    def __init__(self, *, thinking: bool = False, omit_thinking: bool = False) -> None:
        self._thinking = thinking
        self._omit_thinking = omit_thinking  # the thinking block opens and closes with no deltas
        self._next = 0  # index of the next block to open
        self._open: str | None = None  # the kind of the block at index `_next - 1`, while it is open
        self.num_calls = 0

    def events(self, delta: StreamDelta) -> list[Event]:
        out: list[Event] = []
        if delta.reasoning and self._thinking:
            out += self._ensure("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            if not self._omit_thinking:
                out.append(_delta(self._next - 1, {"type": "thinking_delta", "thinking": delta.reasoning}))
        if delta.content:
            out += self._ensure("text", {"type": "text", "text": ""})
            out.append(_delta(self._next - 1, {"type": "text_delta", "text": delta.content}))
        for d in delta.tool_calls:
            if d.first:
                out += self._stop_open()
                out.append(
                    self._start({"type": "tool_use", "id": tool_use_id(d.call), "name": d.call.name, "input": {}})
                )
                self._open = "tool_use"
                self.num_calls += 1
            if d.call.arguments and self._open == "tool_use":
                out.append(_delta(self._next - 1, {"type": "input_json_delta", "partial_json": d.call.arguments}))
        return out

    def close(self) -> list[Event]:
        """The stop of the block still open, or an empty text block when there was no block."""
        if self._next == 0:
            return [self._start({"type": "text", "text": ""}), _stop(0)]
        return self._stop_open()

    def _ensure(self, kind: str, block: dict[str, Any]) -> list[Event]:
        if self._open == kind:
            return []
        out = self._stop_open()
        out.append(self._start(block))
        self._open = kind
        return out

    def _start(self, block: dict[str, Any]) -> Event:
        self._next += 1
        return ("content_block_start", {"type": "content_block_start", "index": self._next - 1, "content_block": block})

    def _stop_open(self) -> list[Event]:
        if self._open is None:
            return []
        self._open = None
        return [_stop(self._next - 1)]


def _delta(index: int, delta: dict[str, Any]) -> Event:
    return ("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta})


def _stop(index: int) -> Event:
    return ("content_block_stop", {"type": "content_block_stop", "index": index})
