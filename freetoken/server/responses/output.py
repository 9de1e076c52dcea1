"""A response's `output` items, built from parsed model output, with the events announcing them.

Owns `OutputItems`: parsed deltas (reasoning, text, complete tool calls) become `reasoning`,
`message` (one `output_text` part) and `function_call` items in the order the model wrote them,
and each step yields the Responses stream events of the published sequence
(`response.output_item.added`, `response.content_part.added`, `response.output_text.delta` /
`.done`, `response.reasoning_text.delta` / `.done`, `response.function_call_arguments.delta` /
`.done`, `response.content_part.done`, `response.output_item.done`), without sequence numbers
(the stream adds them). The non-streamed route feeds the same pieces through the same object
(`stream.feed_piece`), so both paths give the same items and logprobs. Whitespace written before any message or call is held back and
only becomes a message when nothing else was written. A call's arguments go out as the parser
gives them: fragment by fragment where it streams them, else whole in one delta; a call item stays
open until the next item starts or the output ends. With `seal_reasoning`, a finished reasoning
item carries its text as `encrypted_content` (`reasoning.seal`). Token logprobs fed with
a delta go with the message text written next (a message's `logprobs` cover its tokens; those of
reasoning and calls are dropped). Also owns `response_body` and `usage`, the `response`
object's fields. It knows nothing of HTTP or the engine.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from freetoken.server.responses.reasoning import seal
from freetoken.tokenizer.tool_parsers import StreamDelta, ToolCall

Event = dict[str, Any]


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputItems:
    def __init__(self, *, seal_reasoning: bool = False) -> None:
        self._seal = seal_reasoning  # include: ["reasoning.encrypted_content"]
        self.items: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None  # the reasoning, message or function_call item being written
        self._held = ""  # whitespace not yet inside a message
        self._call_index = -1  # the parser's index of the open function_call item
        self._logprobs: list[dict[str, Any]] = []  # of tokens whose text has not reached a message yet

    def feed(self, delta: StreamDelta, logprobs: list[dict[str, Any]] | None = None) -> list[Event]:
        """`logprobs`: the `output_text` logprob entries of the tokens that made `delta`; they go
        with the message text written next (dropped when a reasoning or call item comes first)."""
        self._logprobs += logprobs or []
        if (delta.reasoning or delta.tool_calls) and not delta.content:
            self._logprobs = []
        events: list[Event] = []
        if delta.reasoning:
            events += self._write("reasoning", delta.reasoning)
        if delta.content:
            if self._is_open("message") or delta.content.strip():
                events += self._write("message", self._held + delta.content)
                self._held = ""
            else:
                self._held += delta.content
        for d in delta.tool_calls:
            if d.first or not self._is_open("function_call") or self._call_index != d.index:
                events += self._close("completed")
                events += self._open_call(d.call)
                self._call_index = d.index
            events += self._arguments(d.call.arguments)
        return events

    def finish(self, incomplete: bool) -> list[Event]:
        """Close what is open; a response with no message and no call gets a (maybe empty) message."""
        status = "incomplete" if incomplete else "completed"
        events: list[Event] = []
        if not any(item["type"] in ("message", "function_call") for item in self.items):
            events += self._write("message", self._held)
            self._held = ""
        if self._is_open("message") and self._open is not None:  # tokens whose text was held back to the end
            self._open["content"][0]["logprobs"] += self._logprobs
        self._logprobs = []
        return events + self._close(status)

    def _is_open(self, kind: str) -> bool:
        return self._open is not None and self._open["type"] == kind

    def _write(self, kind: str, text: str) -> list[Event]:
        events: list[Event] = []
        if not self._is_open(kind):
            events += self._close("completed")
            events += self._open_item(kind)
        return events + self._append(text)

    def _open_item(self, kind: str) -> list[Event]:
        if kind == "message":
            item: dict[str, Any] = {
                "id": new_id("msg"),
                "type": "message",
                "role": "assistant",
                "status": "in_progress",
                "content": [],
            }
            part: dict[str, Any] = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        else:
            item = {
                "id": new_id("rs"),
                "type": "reasoning",
                "summary": [],
                "content": [],
                "encrypted_content": None,
                "status": "in_progress",
            }
            part = {"type": "reasoning_text", "text": ""}
        self.items.append(item)
        self._open = item
        index = len(self.items) - 1
        events = [{"type": "response.output_item.added", "output_index": index, "item": {**item, "content": []}}]
        item["content"].append(part)
        events.append(
            {
                "type": "response.content_part.added",
                "item_id": item["id"],
                "output_index": index,
                "content_index": 0,
                "part": dict(part),
            }
        )
        return events

    def _append(self, text: str) -> list[Event]:
        item = self._open
        if item is None or not text:
            return []
        item["content"][0]["text"] += text
        head = {"item_id": item["id"], "output_index": len(self.items) - 1, "content_index": 0, "delta": text}
        if item["type"] == "message":
            logprobs, self._logprobs = self._logprobs, []
            item["content"][0]["logprobs"] += logprobs
            return [{"type": "response.output_text.delta", **head, "logprobs": logprobs}]
        return [{"type": "response.reasoning_text.delta", **head}]

    def _close(self, status: str) -> list[Event]:
        item = self._open
        if item is None:
            return []
        self._open = None
        item["status"] = status
        index = len(self.items) - 1
        if item["type"] == "function_call":
            head = {"item_id": item["id"], "output_index": index}
            return [
                {
                    "type": "response.function_call_arguments.done",
                    **head,
                    "name": item["name"],
                    "arguments": item["arguments"],
                },
                {"type": "response.output_item.done", "output_index": index, "item": item},
            ]
        part = item["content"][0]
        head = {"item_id": item["id"], "output_index": index, "content_index": 0}
        if item["type"] == "reasoning" and self._seal:
            item["encrypted_content"] = seal(part["text"])
        if item["type"] == "message":
            done: Event = {
                "type": "response.output_text.done",
                **head,
                "text": part["text"],
                "logprobs": part["logprobs"],
            }
        else:
            done = {"type": "response.reasoning_text.done", **head, "text": part["text"]}
        return [
            done,
            {"type": "response.content_part.done", **head, "part": part},
            {"type": "response.output_item.done", "output_index": index, "item": item},
        ]

    def _open_call(self, call: ToolCall) -> list[Event]:
        item = {
            "id": new_id("fc"),
            "type": "function_call",
            "status": "in_progress",
            "call_id": call.id,
            "name": call.name,
            "arguments": "",
        }
        self.items.append(item)
        self._open = item
        return [{"type": "response.output_item.added", "output_index": len(self.items) - 1, "item": dict(item)}]

    def _arguments(self, text: str) -> list[Event]:
        item = self._open
        if item is None or not text:
            return []
        item["arguments"] += text
        return [
            {
                "type": "response.function_call_arguments.delta",
                "item_id": item["id"],
                "output_index": len(self.items) - 1,
                "delta": text,
            }
        ]


def usage(input_tokens: int, output_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": input_tokens,
        # every prompt token the engine computes goes into the prefix cache
        "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": input_tokens - cached_tokens},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": input_tokens + output_tokens,
    }


def response_body(
    response_id: str,
    created_at: int,
    model: str,
    request: dict[str, Any],
    *,
    status: str,
    output: list[dict[str, Any]],
    usage_doc: dict[str, Any] | None,
    incomplete_reason: str | None = None,
) -> dict[str, Any]:
    """The `response` object; `request` holds the echoed request fields (see `echo_fields`)."""
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": status,
        "completed_at": int(time.time()) if status in ("completed", "incomplete") else None,
        "error": None,
        "incomplete_details": None if incomplete_reason is None else {"reason": incomplete_reason},
        "model": model,
        "output": output,
        "usage": usage_doc,
        **request,
    }
