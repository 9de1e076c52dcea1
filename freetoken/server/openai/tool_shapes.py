"""Parsed tool calls and reasoning in chat completions' shapes.

Owns the assistant `message` of a non-streamed choice (`content`, `reasoning_content`,
`tool_calls`), a stream chunk's `delta` (a call's id, type and name in its first delta, argument
text after), and `finish_reason` (`tool_calls` for an output that called tools). The parsing
itself is `core.tool_calling`'s.
"""

from __future__ import annotations

from typing import Any

from freetoken.tokenizer.tool_parsers import ParsedOutput, StreamDelta


def finish_reason(reason: str | None, num_calls: int) -> str | None:
    """`tool_calls` replaces a normal end when the output held calls; a call cut off by max_tokens
    ends with `length`."""
    return "tool_calls" if num_calls and reason == "stop" else reason


def openai_tool_calls(out: ParsedOutput | StreamDelta) -> list[dict[str, Any]]:
    """OpenAI's `tool_calls` items; stream deltas carry `index`, and the id, type and name only
    in a call's first delta (later ones add argument text)."""
    if isinstance(out, StreamDelta):
        return [
            {
                "index": d.index,
                "id": d.call.id,
                "type": "function",
                "function": {"name": d.call.name, "arguments": d.call.arguments},
            }
            if d.first
            else {"index": d.index, "function": {"arguments": d.call.arguments}}
            for d in out.tool_calls
        ]
    return [
        {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in out.tool_calls
    ]


def openai_message(out: ParsedOutput) -> dict[str, Any]:
    """The assistant `message` of a non-streamed choice."""
    message: dict[str, Any] = {
        "role": "assistant",
        "content": out.content if out.content or not out.tool_calls else None,
    }
    if out.reasoning:
        message["reasoning_content"] = out.reasoning
    if out.tool_calls:
        message["tool_calls"] = openai_tool_calls(out)
    return message


def openai_delta(delta: StreamDelta) -> dict[str, Any]:
    """A stream chunk's `delta` (empty when nothing is certain yet)."""
    out: dict[str, Any] = {}
    if delta.reasoning:
        out["reasoning_content"] = delta.reasoning
    if delta.content:
        out["content"] = delta.content
    if delta.tool_calls:
        out["tool_calls"] = openai_tool_calls(delta)
    return out
