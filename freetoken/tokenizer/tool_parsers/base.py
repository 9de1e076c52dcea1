"""The shapes every tool-call parser shares: parsed calls, stream deltas and the parser ABC.

Owns `ToolCall`, `ParsedOutput`, `ToolCallDelta`, `StreamDelta`, the `ToolParser` and
`ToolCallStream` ABCs (five real formats implement them) and `merge_deltas`, which makes a full
parse the sum of a stream's deltas (a call's argument fragments joined), so the two never
disagree. It knows no format and no HTTP:
the server turns these into OpenAI or Anthropic bodies.
"""

from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar


def new_call_id() -> str:
    """A fresh OpenAI-style tool-call id."""
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolCall:
    """One parsed call. `arguments` is JSON text of an object."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class ParsedOutput:
    """A whole generation split into plain text, reasoning and tool calls."""

    content: str
    reasoning: str
    tool_calls: tuple[ToolCall, ...]


@dataclass(frozen=True)
class ToolCallDelta:
    """A call, or a piece of one. A call whose format lets its arguments stream (Hermes) comes as
    a `first` delta carrying its id, name and the arguments so far, then deltas of the same
    `index` carrying further argument text (`call.arguments` is the fragment): joined, the
    fragments are the call's arguments. Other calls come whole, in one `first` delta, once
    their block is closed and valid (a block that turns out malformed can then still be text)."""

    index: int
    call: ToolCall
    first: bool = True


@dataclass
class StreamDelta:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls)

    def extend(self, other: StreamDelta) -> None:
        self.content += other.content
        self.reasoning += other.reasoning
        self.tool_calls += other.tool_calls


def join_calls(deltas: Iterable[ToolCallDelta]) -> tuple[ToolCall, ...]:
    """The calls that a stream's call deltas make, in index order, argument fragments joined."""
    calls: dict[int, ToolCall] = {}
    for d in deltas:
        if d.first or d.index not in calls:
            calls[d.index] = d.call
        else:
            prev = calls[d.index]
            calls[d.index] = ToolCall(prev.id, prev.name, prev.arguments + d.call.arguments)
    return tuple(calls[i] for i in sorted(calls))


def merge_deltas(deltas: Iterable[StreamDelta]) -> ParsedOutput:
    total = StreamDelta()
    for delta in deltas:
        total.extend(delta)
    return ParsedOutput(total.content, total.reasoning, join_calls(total.tool_calls))


def arguments_json(value: object) -> str | None:
    """Call arguments as compact JSON text of an object; None when they are not an object (a JSON
    string holding an object is accepted, as some models double-encode)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return None
    if not isinstance(value, dict):
        return None
    return json.dumps(value, ensure_ascii=False)


def call_from_object(obj: object, tool_names: frozenset[str] | None) -> ToolCall | None:
    """`{"name": N, "arguments"|"parameters": {...}}` -> ToolCall, or None when the object is not a
    call of a known tool."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    name = obj["name"]
    if tool_names is not None and name not in tool_names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    text = arguments_json(args)
    return None if text is None else ToolCall(new_call_id(), name, text)


class CallGapContent:
    """Content between calls, for a stream that keeps `_after_call` (the last thing released was
    a call: drop leading whitespace) and `_pending_ws` (trailing whitespace of content, released
    only with the next text, so a call that follows does not leave it dangling)."""

    _after_call: bool
    _pending_ws: str

    def _content(self, text: str, out: StreamDelta) -> None:
        if self._after_call:
            text = text.lstrip()
            if not text:
                return
            self._after_call = False
        body = text.rstrip()
        if body:
            out.content += self._pending_ws + body
            self._pending_ws = text[len(body) :]
        else:
            self._pending_ws += text


class ToolCallStream(ABC):
    """The incremental parser of one generation: feed text deltas, get what is now certain.

    A subclass keeps the unparsed text in `self._buffer` and says how far one parsing step goes
    (`_step`) and what the rest becomes at the end (`_flush`)."""

    _buffer: str

    def feed(self, text: str) -> StreamDelta:
        """The content, reasoning and complete calls that `text` (appended to what came before)
        makes certain; text that may still be the start of a marker is held back."""
        self._buffer += text
        out = StreamDelta()
        while self._step(out, final=False):
            pass
        return out

    def finish(self) -> StreamDelta:
        """Everything still held back (an unclosed block becomes text)."""
        out = StreamDelta()
        while self._step(out, final=True):
            pass
        self._flush(out)
        return out

    @abstractmethod
    def _step(self, out: StreamDelta, *, final: bool) -> bool:
        """Parse what the buffer allows into `out`; True when another step may make progress."""

    @abstractmethod
    def _flush(self, out: StreamDelta) -> None:
        """At the end of the output: turn what is left in the buffer into `out`."""


class ToolParser(ABC):
    """One model family's tool-call format: the prompt that asks for it, the rendering of earlier
    calls and results, and the parsing of output. `tool_names` limits accepted calls (None: any);
    `schemas` (tool name -> its parameters' JSON schema) types the values of formats that write
    them as text; `marker_tokens` (marker text -> token id) are the format's `markers` that are
    tokens of their own in the model's vocabulary (added tokens), which a forced-call grammar
    names by id."""

    name: ClassVar[str]
    # True when the format's markers are special tokens that skip_special_tokens would remove.
    needs_special_tokens: ClassVar[bool] = False
    # The fixed texts the format's calls are made of (a model's vocabulary may hold them as tokens).
    markers: ClassVar[tuple[str, ...]] = ()

    def __init__(
        self,
        tool_names: Iterable[str] | None = None,
        *,
        schemas: Mapping[str, Mapping[str, Any]] | None = None,
        marker_tokens: Mapping[str, int] | None = None,
    ) -> None:
        self.tool_names: frozenset[str] | None = None if tool_names is None else frozenset(tool_names)
        self.schemas: dict[str, Mapping[str, Any]] = dict(schemas or {})
        self.marker_tokens: dict[str, int] = dict(marker_tokens or {})

    def template_call_id(self, call_id: str) -> str:
        """A call's id as this family's chat template takes it (the same id in, the same id out)."""
        return call_id

    def properties(self, tool: str) -> Mapping[str, Any]:
        """The `properties` of `tool`'s parameters schema ({} when unknown)."""
        props = self.schemas.get(tool, {}).get("properties")
        return props if isinstance(props, Mapping) else {}

    @abstractmethod
    def stream(self) -> ToolCallStream:
        """A fresh incremental parser for one generation."""

    def parse(self, text: str) -> ParsedOutput:
        """The whole generation parsed (the same result as streaming it in any chunks)."""
        s = self.stream()
        return merge_deltas([s.feed(text), s.finish()])

    @abstractmethod
    def tool_prompt(self, tools: Sequence[Mapping[str, Any]], *, parallel: bool) -> str:
        """A system-prompt block listing `tools` (OpenAI `{"type": "function", "function": ...}`)
        and the exact call format this parser reads, for templates that do not render tools."""

    @abstractmethod
    def format_calls(self, calls: Sequence[ToolCall]) -> str:
        """Earlier calls of an assistant turn as the model would have written them."""

    @abstractmethod
    def forced_grammar(self, tools: Sequence[Mapping[str, Any]]) -> str:
        """A Lark grammar (llguidance) whose every sentence is one call of one of `tools` in this
        format (for `tool_choice: "required"` or a named function)."""

    def format_result(self, content: str, name: str | None) -> str:
        """A tool result as text of a user turn (templates without a `tool` role)."""
        label = f" name={json.dumps(name)}" if name else ""
        return f"<tool_response{label}>\n{content}\n</tool_response>"


def tools_json(tools: Sequence[Mapping[str, Any]]) -> str:
    """The function schemas, one JSON object a line."""
    return "\n".join(json.dumps(t.get("function", t), ensure_ascii=False) for t in tools)
