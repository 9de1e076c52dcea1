"""The incremental parser of formats whose calls sit in marked blocks of otherwise plain text.

Owns `BlockStream`: text outside blocks streams out as content, holding back any suffix that may
start a marker; a block (`start` ... `end`, or `start` ... end of output when `end` is None, or a
bare JSON value that opens the output) is buffered whole, then handed to the format's
`parse_block`. A block that does not parse (broken JSON, an unknown tool, never closed) is
released as the text it was. Whitespace between content and a call is dropped. It knows no
particular format: Hermes, Gemma and Llama 3 JSON configure it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from freetoken.tokenizer.detokenizer import held_back
from freetoken.tokenizer.tool_parsers.base import StreamDelta, ToolCall, ToolCallDelta, ToolCallStream

BlockParser = Callable[[str], list[ToolCall] | None]


@dataclass(frozen=True)
class BlockMarker:
    start: str
    end: str | None  # None: the block runs to the end of the output


class BlockStream(ToolCallStream):
    def __init__(self, markers: Sequence[BlockMarker], parse_block: BlockParser, *, bare_json_at_start: bool) -> None:
        self._markers = tuple(markers)
        self._starts = tuple(m.start for m in markers)
        self._parse_block = parse_block
        self._bare = bare_json_at_start
        self._buffer = ""
        self._block: BlockMarker | None = None  # the open block, or None while in text
        self._at_start = True  # nothing but whitespace seen yet
        self._after_call = False  # the last thing released was a call: drop leading whitespace
        self._pending_ws = ""  # trailing whitespace of content, released with the next text
        self._num_calls = 0

    def _flush(self, out: StreamDelta) -> None:
        if self._block is not None and self._block.end is None:  # runs to the end: parse it now
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
                self._block = BlockMarker("", None)
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

    def _close_block(self, marker: BlockMarker, body: str, out: StreamDelta, *, final_marker: str) -> None:
        self._block = None
        calls = self._parse_block(body)
        if not calls:
            self._content(marker.start + body + final_marker, out)
            return
        self._pending_ws = ""
        for call in calls:
            out.tool_calls.append(ToolCallDelta(self._num_calls, call))
            self._num_calls += 1
        self._after_call = True
