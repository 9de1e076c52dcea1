"""The streaming skeleton of formats whose calls open with a marker and are then read state by state.

Owns `MarkedCallStream`: the buffer and the state name (`_step` runs the method `_<state>`), the
`text` state (content, holding back what may start one of the format's `OPENERS`; a marker found
is kept in `_opened` and leads to the state the format names for it), the release of an opened
marker that turned out to be no call (`_not_a_call`), a call's announcement, argument fragments
and end (`_announce`, `_emit`, `_end_call`), and `_flush` (a call cut off stays a call; an
undecided opening is text). The whitespace between content and calls is `CallGapContent`'s.
`PairedArgumentsStream` is the skeleton for formats that write arguments as key / raw-value pairs
(Qwen3-Coder, GLM-4.5): an `ArgumentWriter` per call, typed by the tool's schema.

It knows no format: the states after the opening marker, what a call looks like and what ends
it are each format's (qwen3_coder.py, glm45.py, mistral.py). Formats read as whole blocks are
blocks.py's; Gemma 4's stream (gemma4.py) keeps its own.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Mapping
from typing import ClassVar

from freetoken.tokenizer.detokenizer import held_back
from freetoken.tokenizer.tool_parsers.base import (
    CallGapContent,
    StreamDelta,
    ToolCall,
    ToolCallDelta,
    ToolCallStream,
    ToolParser,
    new_call_id,
)
from freetoken.tokenizer.tool_parsers.typed_arguments import ArgumentWriter


class MarkedCallStream(CallGapContent, ToolCallStream):
    """A stream in a named state. A subclass names its `OPENERS` (marker -> the state after it)
    and `UNDECIDED` (the states in which the opened marker may still be text), writes a method
    `_<state>(out, final) -> bool` for each of its states past `text`, and says whether a call is
    open (`_in_call`) and what closing one writes (`_close_call`)."""

    OPENERS: ClassVar[Mapping[str, str]]
    UNDECIDED: ClassVar[tuple[str, ...]]

    def __init__(self, tool_names: frozenset[str] | None) -> None:
        self._names = tool_names
        self._buffer = ""
        self._state = "text"
        self._opened = ""  # the marker text an opening consumed (released if it is no call)
        self._num_calls = 0
        self._after_call = False
        self._pending_ws = ""

    def _step(self, out: StreamDelta, *, final: bool) -> bool:
        return getattr(self, "_" + self._state)(out, final)

    def _text(self, out: StreamDelta, final: bool) -> bool:
        hits = [(i, m) for m in self.OPENERS if (i := self._buffer.find(m)) >= 0]
        if hits:
            i, marker = min(hits)
            self._content(self._buffer[:i], out)
            self._buffer, self._opened = self._buffer[i + len(marker) :], marker
            self._open(marker)
            return True
        keep = 0 if final else held_back(self._buffer, tuple(self.OPENERS))
        self._content(self._buffer[: len(self._buffer) - keep], out)
        self._buffer = self._buffer[len(self._buffer) - keep :]
        return False

    def _open(self, marker: str) -> None:
        """`marker` was read (it is in `_opened`): go to the state it leads to."""
        self._state = self.OPENERS[marker]

    def _known(self, name: str) -> bool:
        return self._names is None or name in self._names

    def _not_a_call(self, out: StreamDelta, text: str | None = None) -> bool:
        """What was opened is no call of a known tool: the opening (or `text`, what was read of
        it) is content, the rest is read again."""
        self._content(self._opened if text is None else text, out)
        self._opened, self._state = "", "text"
        return True

    def _announce(self, name: str, out: StreamDelta) -> None:
        """A known tool was named: the call's first delta; whitespace held before it is dropped."""
        self._begin_call(ToolCall(new_call_id(), name, ""), out)

    def _begin_call(self, call: ToolCall, out: StreamDelta) -> None:
        self._pending_ws = ""
        out.tool_calls.append(ToolCallDelta(self._num_calls, call))

    def _emit(self, fragment: str, out: StreamDelta) -> None:
        """Argument text of the open call."""
        if fragment:
            out.tool_calls.append(ToolCallDelta(self._num_calls, ToolCall("", "", fragment), first=False))

    def _end_call(self, out: StreamDelta, state: str = "text") -> None:
        """The open call is complete (or cut off): what closing it writes, then `state`."""
        self._close_call(out)
        self._state, self._opened = state, ""
        self._num_calls += 1
        self._after_call = True

    @property
    @abstractmethod
    def _in_call(self) -> bool:
        """A call was announced and has not ended."""

    @abstractmethod
    def _close_call(self, out: StreamDelta) -> None:
        """Write what ends the open call's arguments into `out` and drop its reader."""

    def _flush(self, out: StreamDelta) -> None:
        if self._in_call:  # cut off inside an announced call: it stays a call
            self._end_call(out)
        elif self._state in self.UNDECIDED:
            self._content(self._opened + self._buffer, out)
        elif self._buffer:
            self._content(self._buffer, out)
        self._buffer, self._state = "", "text"
        if not self._after_call:
            out.content += self._pending_ws
        self._pending_ws = ""


class PairedArgumentsStream(MarkedCallStream):
    """A marked stream whose calls' arguments are key / raw-value pairs: the open call's
    `ArgumentWriter` (`_writer`) turns them into JSON, each value typed by the tool's schema."""

    def __init__(self, parser: ToolParser) -> None:
        super().__init__(parser.tool_names)
        self._parser = parser
        self._args: ArgumentWriter | None = None

    def _announce(self, name: str, out: StreamDelta) -> None:
        super()._announce(name, out)
        self._args = ArgumentWriter(self._parser.properties(name))

    @property
    def _writer(self) -> ArgumentWriter:
        assert self._args is not None
        return self._args

    @property
    def _in_call(self) -> bool:
        return self._args is not None

    def _close_call(self, out: StreamDelta) -> None:
        self._emit(self._writer.close(), out)
        self._args = None
