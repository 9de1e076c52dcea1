"""The incremental parser of formats whose calls sit in marked blocks of otherwise plain text.

Owns `BlockStream`: text outside blocks streams out as content, holding back any suffix that may
start a marker; a block (`start` ... `end`, or `start` ... end of output when `end` is None, or a
bare JSON value that opens the output) is buffered whole, then handed to the format's
`parse_block`. A block that does not parse (broken JSON, an unknown tool, never closed) is
released as the text it was. A format may name an `ArgumentsHead` reader for its blocks: once the
head of a block names a known tool and its arguments object has begun, the call is announced and
its arguments stream out as they are written (the block is then a call whatever follows: a cut-off
block is a call with the arguments written so far). In a block that runs to the end of the output
(Llama 3's, or a bare JSON value), a streamed call's object may be followed by `;`, `,` or another
object: each further call's head is read and streamed the same way (other text after the object is
content again). Whitespace between content and
a call is dropped. It knows no particular format: Hermes, Gemma and Llama 3 JSON configure it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from freetoken.tokenizer.detokenizer import held_back
from freetoken.tokenizer.tool_parsers.base import (
    CallGapContent,
    StreamDelta,
    ToolCall,
    ToolCallDelta,
    ToolCallStream,
    new_call_id,
)

BlockParser = Callable[[str], list[ToolCall] | None]
_DECODER = json.JSONDecoder()
# The head of a block body so far -> (tool name, offset where its arguments object starts), False
# when the block cannot stream (it is parsed whole at its end), None while undecided.
ArgumentsHead = Callable[[str], "tuple[str, int] | Literal[False] | None"]


@dataclass(frozen=True)
class BlockMarker:
    start: str
    end: str | None  # None: the block runs to the end of the output
    head: ArgumentsHead | None = None


def object_head(
    body: str, keys: tuple[str, str], tool_names: frozenset[str] | None
) -> tuple[str, int] | Literal[False] | None:
    """Reads `{"<keys[0]>": "<name>", "<keys[1]>": {` at the start of `body` (whitespace anywhere
    JSON allows it): the name of a known tool and the offset of the arguments object, False once
    the body cannot be that, None while it may still become it."""
    i, n = 0, len(body)

    def skip(i: int) -> int:
        while i < n and body[i] in " \t\r\n":
            i += 1
        return i

    def literal(i: int, text: str) -> int | Literal[False] | None:
        i = skip(i)
        if n - i < len(text):
            return None if text.startswith(body[i:]) else False
        return i + len(text) if body.startswith(text, i) else False

    def expect(i: int, texts: tuple[str, ...]) -> int | Literal[False] | None:
        """Past `texts` in order and the blanks after them; None where the body ends first."""
        for text in texts:
            got = literal(i, text)
            if not got:
                return got
            i = got
        i = skip(i)
        return None if i == n else i

    got = expect(i, ("{", json.dumps(keys[0]), ":"))
    if not got:
        return got
    i = got
    if body[i] != '"':
        return False
    try:
        name, i = _DECODER.raw_decode(body, i)
    except ValueError:
        return None if '"' not in body[i + 1 :] else False
    if tool_names is not None and name not in tool_names:
        return False
    got = expect(i, (",", json.dumps(keys[1]), ":"))
    if not got:
        return got
    i = got
    return (name, i) if body[i] == "{" else False


def call_head(
    body: str, arg_keys: tuple[str, ...], tool_names: frozenset[str] | None
) -> tuple[str, int] | Literal[False] | None:
    """`object_head` for a call object whose arguments may sit under any of `arg_keys`
    (`"parameters"` or `"arguments"`): the first reading that succeeds, None while any may."""
    heads = [object_head(body, ("name", key), tool_names) for key in arg_keys]
    for head in heads:
        if head:
            return head
    return None if any(head is None for head in heads) else False


class JsonValueEnd:
    """Finds where one JSON object or array ends in text fed piece by piece (strings and escapes
    respected)."""

    def __init__(self) -> None:
        self._depth = 0
        self.in_string = False
        self._escape = False

    def scan(self, text: str) -> int | None:
        """The length of `text` up to and including the value's last character, or None when
        the value goes on past it."""
        for i, ch in enumerate(text):
            if self.in_string:
                if self._escape:
                    self._escape = False
                elif ch == "\\":
                    self._escape = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    return i + 1
        return None


class BlockStream(CallGapContent, ToolCallStream):
    def __init__(
        self,
        markers: Sequence[BlockMarker],
        parse_block: BlockParser,
        *,
        bare_json_at_start: bool,
        bare_head: ArgumentsHead | None = None,
    ) -> None:
        self._markers = tuple(markers)
        self._starts = tuple(m.start for m in markers)
        self._parse_block = parse_block
        self._bare = bare_json_at_start
        self._bare_head = bare_head  # the head reader of a bare JSON value opening the output
        self._buffer = ""
        self._block: BlockMarker | None = None  # the open block, or None while in text
        self._at_start = True  # nothing but whitespace seen yet
        self._after_call = False  # the last thing released was a call: drop leading whitespace
        self._pending_ws = ""  # trailing whitespace of content, released with the next text
        self._num_calls = 0
        self._head_tried = False  # the open block's head reader said it cannot stream
        self._streaming: JsonValueEnd | None = None  # the open block's call is streaming its arguments
        self._args_done = False  # ... and its arguments object is complete

    def _flush(self, out: StreamDelta) -> None:
        if self._streaming is not None:  # cut off inside a streaming call: it stays a call
            self._end_streaming()
            self._buffer = ""
        elif self._block is not None and self._block.end is None:  # runs to the end: parse it now
            self._close_block(self._block, self._buffer, out, final_marker="")
            self._buffer = ""
        elif self._block is not None:  # never closed: malformed, so it is text
            self._content(self._block.start + self._buffer, out)
            self._block, self._buffer = None, ""
        if self._buffer:
            self._content(self._buffer, out)
            self._buffer = ""
        if not self._after_call:
            out.content += self._pending_ws
        self._pending_ws = ""

    # ---- internals ---------------------------------------------------------------------------

    def _step(self, out: StreamDelta, *, final: bool) -> bool:
        """Consume what can be decided now; True when the buffer changed state and may hold more."""
        if self._block is not None:
            if self._streaming is not None or (self._block.head is not None and not self._head_tried):
                return self._stream_call(out)
            if self._block.end is None:
                return False  # runs to the end of the output: decided at finish
            end = self._block.end
            j = self._buffer.find(end)
            if j < 0:
                return False
            body, self._buffer = self._buffer[:j], self._buffer[j + len(end) :]
            self._close_block(self._block, body, out, final_marker=end)
            return True
        if self._at_start:
            stripped = self._buffer.lstrip()
            if not stripped:
                return False
            self._at_start = False
            if self._bare and stripped[0] in "{[":
                self._pending_ws = ""
                self._buffer = stripped
                self._block = BlockMarker("", None, self._bare_head)
                return True
        hits = [(self._buffer.find(m.start), m) for m in self._markers]
        hits = [(i, m) for i, m in hits if i >= 0]
        if hits:
            i, marker = min(hits, key=lambda h: (h[0], -len(h[1].start)))
            self._content(self._buffer[:i], out)
            self._buffer = self._buffer[i + len(marker.start) :]
            self._block = marker
            return True
        keep = 0 if final else held_back(self._buffer, self._starts)
        self._content(self._buffer[: len(self._buffer) - keep], out)
        self._buffer = self._buffer[len(self._buffer) - keep :]
        return False

    def _stream_call(self, out: StreamDelta) -> bool:
        """The open block while its head is read, then while its call's arguments stream."""
        assert self._block is not None
        if self._streaming is None:
            head = self._block.head(self._buffer) if self._block.head is not None else False
            if head is None:
                return False
            if head is False:
                self._head_tried = True
                return True
            name, offset = head
            self._pending_ws = ""
            out.tool_calls.append(ToolCallDelta(self._num_calls, ToolCall(new_call_id(), name, "")))
            self._streaming, self._args_done = JsonValueEnd(), False
            self._buffer = self._buffer[offset:]
        if not self._args_done:
            return self._stream_arguments(self._streaming, out)
        if self._block.end is None:
            return self._next_in_run()
        j = self._buffer.find(self._block.end)
        if j < 0:
            self._buffer = self._buffer[len(self._buffer) - held_back(self._buffer, (self._block.end,)) :]
            return False
        self._buffer = self._buffer[j + len(self._block.end) :]
        self._end_streaming()
        return True

    def _stream_arguments(self, scanner: JsonValueEnd, out: StreamDelta) -> bool:
        """Argument text up to the end of the object, or up to an end marker outside a string
        (the block closed before its arguments did: the call ends there)."""
        assert self._block is not None
        end = self._block.end
        j = -1 if end is None else self._buffer.find(end)
        upto = len(self._buffer) if j < 0 else j
        if j < 0 and end is not None:
            upto -= held_back(self._buffer, (end,))
        value_end = scanner.scan(self._buffer[:upto])
        cut = upto if value_end is None else value_end
        if cut:
            out.tool_calls.append(ToolCallDelta(self._num_calls, ToolCall("", "", self._buffer[:cut]), first=False))
        self._buffer = self._buffer[cut:]
        if value_end is not None:
            self._args_done = True
            return True
        if j < 0:
            return False
        assert end is not None
        if scanner.in_string:  # the marker is text inside a string of the arguments
            scanner.scan(end)
            out.tool_calls.append(ToolCallDelta(self._num_calls, ToolCall("", "", end), first=False))
            self._buffer = self._buffer[len(end) :]
            return True
        self._buffer = self._buffer[len(end) :]
        self._end_streaming()
        return True

    def _next_in_run(self) -> bool:
        """After a streamed call's arguments, in a block that runs to the end: the call object's
        `}`, then `;` / `,` or the next object starts the next call (read by the same head); other
        text after the `}` ends the block and is content again. Text that is not the `}` is
        dropped at the end of the output (the call stands, as any announced call does)."""
        rest = self._buffer.lstrip()
        if not rest.startswith("}"):
            return False
        after = rest[1:].lstrip()
        if not after:
            return False
        if after[0] not in ";,{":
            self._buffer = after
            self._end_streaming()
            return True
        self._buffer = after[1:] if after[0] in ";," else after
        self._streaming, self._head_tried = None, False
        self._num_calls += 1
        return True

    def _end_streaming(self) -> None:
        self._block, self._streaming, self._head_tried = None, None, False
        self._num_calls += 1
        self._after_call = True

    def _close_block(self, marker: BlockMarker, body: str, out: StreamDelta, *, final_marker: str) -> None:
        self._block, self._head_tried = None, False
        calls = self._parse_block(body)
        if not calls:
            self._content(marker.start + body + final_marker, out)
            return
        self._pending_ws = ""
        for call in calls:
            out.tool_calls.append(ToolCallDelta(self._num_calls, call))
            self._num_calls += 1
        self._after_call = True
