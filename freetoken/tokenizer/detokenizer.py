"""Incremental detokenization with stop strings.

Owns `IncrementalDetokenizer`: generated token ids go in one at a time, and out comes only text
that is final -- never half of a multi-byte character, never text a later token could still change,
never text that might be the start of a stop string. The concatenation of everything it emits
(including `finish()`) equals `tokenizer.decode(ids)` of the ids fed, cut before the first stop
string. Each step decodes a short trailing window, not the whole sequence. It does not decide when
generation ends on token ids (the engine's stop ids do that) and does not sample.

Why a window works: decoding ids[p:] and ids[p:r] shares the same first token, so any decoder step
that treats the first token specially (a stripped leading space) affects both alike and the new text
is the difference. The window start only moves to a point where the text was complete: not inside
a UTF-8 character (the text then ends in U+FFFD) and not inside a run of byte-fallback tokens (the
whole run is decoded together, and one bad byte turns every byte of the run into U+FFFD).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from freetoken.tokenizer.tokenizer import Tokenizer

REPLACEMENT_CHAR = "\ufffd"


@dataclass(frozen=True)
class DetokenizerDelta:
    """What one step produced: `text` is new final text; `stop_string` is set when a stop string
    was matched (the text before it is in `text`; generation must end)."""

    text: str
    stop_string: str | None = None


class IncrementalDetokenizer:
    """Streaming decode of one request's generated ids.

    `context_ids` (e.g. the last few prompt ids) seed the window so the first generated token
    decodes as it does after the prompt (a SentencePiece leading space is kept); their own text is
    never emitted. `stop` strings end the text; the emitted text excludes the stop string unless
    `include_stop_string`. `hidden_ids` (the end-of-generation tokens) are never decoded, even with
    special tokens kept: a format that needs its special markers does not get `</s>` as text."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        skip_special_tokens: bool = False,
        stop: Sequence[str] = (),
        include_stop_string: bool = False,
        context_ids: Sequence[int] = (),
        hidden_ids: Collection[int] = (),
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._hidden = frozenset(hidden_ids)
        self._stops = tuple(s for s in stop if s)
        self._include_stop = include_stop_string
        # Ids the window sees: the fed ids, minus skipped special ids (decode drops them anyway).
        self._ids: list[int] = []
        self._prefix_offset = 0  # window start: text of ids[:prefix_offset] is settled
        self._read_offset = 0  # text of ids[:read_offset] has been released to the stop filter
        self._pending = ""  # released text held back as a possible stop-string start
        self._emitted: list[str] = []
        self.stop_string: str | None = None
        self._finished = False
        context = [i for i in context_ids if not self._skipped(i)]
        if context and context[-1] not in tokenizer.byte_fallback_ids:
            text = tokenizer.decode(context)
            if not text.endswith(REPLACEMENT_CHAR):
                self._ids = context
                self._read_offset = len(context)

    @property
    def stopped(self) -> bool:
        """True once a stop string has matched; further ids are ignored."""
        return self.stop_string is not None

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        return "".join(self._emitted)

    def _skipped(self, token_id: int) -> bool:
        return token_id in self._hidden or (self._skip_special and token_id in self._tokenizer.special_ids)

    def _decode(self, start: int, end: int | None = None) -> str:
        return self._tokenizer.decode(self._ids[start:end])

    def add(self, token_id: int) -> DetokenizerDelta:
        """Feed one generated id; returns the text that became final."""
        return self.add_many((token_id,))

    def add_many(self, token_ids: Sequence[int]) -> DetokenizerDelta:
        """Feed several generated ids at once."""
        if self._finished or self.stopped:
            return DetokenizerDelta("")
        self._ids.extend(i for i in token_ids if not self._skipped(i))
        if len(self._ids) == self._read_offset or self._ids[-1] in self._tokenizer.byte_fallback_ids:
            return DetokenizerDelta("")  # nothing new, or a byte run that may still go bad
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        new_text = self._decode(self._prefix_offset)
        if new_text.endswith(REPLACEMENT_CHAR) or not new_text.startswith(prefix_text):
            return DetokenizerDelta("")  # an incomplete character: wait for its next byte
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return self._release(new_text[len(prefix_text) :], final=False)

    def finish(self) -> DetokenizerDelta:
        """End of generation: release everything still held (an incomplete character becomes
        U+FFFD, as in `decode`)."""
        if self._finished or self.stopped:
            self._finished = True
            return DetokenizerDelta("")
        self._finished = True
        tail = ""
        if self._read_offset < len(self._ids):
            prefix_text = self._decode(self._prefix_offset, self._read_offset)
            tail = self._decode(self._prefix_offset)[len(prefix_text) :]
            self._prefix_offset = self._read_offset = len(self._ids)
        return self._release(tail, final=True)

    def _release(self, new_text: str, *, final: bool) -> DetokenizerDelta:
        """Pass text through the stop-string filter."""
        if not self._stops:
            return self._emit(new_text)
        pending = self._pending + new_text
        match = _first_stop(pending, self._stops)
        if match is not None:
            start, stop = match
            self._pending = ""
            self.stop_string = stop
            out = pending[: start + len(stop)] if self._include_stop else pending[:start]
            return DetokenizerDelta(self._emit(out).text, stop)
        keep = 0 if final else held_back(pending, self._stops)
        self._pending = pending[len(pending) - keep :] if keep else ""
        return self._emit(pending[: len(pending) - keep])

    def _emit(self, text: str) -> DetokenizerDelta:
        if text:
            self._emitted.append(text)
        return DetokenizerDelta(text)


def _first_stop(text: str, stops: Sequence[str]) -> tuple[int, str] | None:
    """The stop string that completes first in `text` (ties: the one starting first), with its
    start index."""
    best: tuple[int, int, str] | None = None
    for stop in stops:
        start = text.find(stop)
        if start < 0:
            continue
        key = (start + len(stop), start, stop)
        if best is None or key[:2] < best[:2]:
            best = key
    return None if best is None else (best[1], best[2])


def held_back(text: str, markers: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `markers` (a stop
    string, a tool-call marker): text that may still become one and must not be released yet."""
    longest = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), longest, -1):
            if text.endswith(marker[:n]):
                longest = n
                break
    return longest
