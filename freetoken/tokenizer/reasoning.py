"""Reasoning written as `<think>...</think>` (Qwen 3, DeepSeek R1 and their distills): splitting a
generation into its reasoning and the rest, incrementally.

Owns `ThinkStream` (feed text deltas, get the reasoning and the content they make certain; text
that may still be the start of a marker is held back), `REASONING_PARSERS` (the names
`--reasoning-parser` accepts) and `detect_reasoning_parser` (the model's template or vocabulary
names `<think>`). The reasoning may open in the prompt (DeepSeek R1's template ends its generation
prompt with `<think>`), so a stream can start inside it. An unclosed reasoning block (the output
was cut) is all reasoning. Harmony's channels are the Harmony tool parser's, not this module's.
Tool calls inside the content are the tool parser's to find; this module knows no tools and no HTTP.
"""

from __future__ import annotations

from collections.abc import Iterable

from freetoken.tokenizer.detokenizer import held_back

THINK_START, THINK_END = "<think>", "</think>"
THINK = "think"
REASONING_PARSERS = (THINK, "none")


class ThinkStream:
    """One generation's split. Whitespace right inside the markers and right after the end is
    dropped."""

    def __init__(self, *, in_reasoning: bool) -> None:
        self._buffer = ""
        self._state = "reasoning" if in_reasoning else "start"  # start -> reasoning -> content, or start -> content
        self._fresh = in_reasoning  # at the start of the reasoning: drop leading whitespace
        self._pending_ws = ""  # trailing whitespace of the reasoning, released with the next text

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, content) that `text`, appended to what came before, makes certain."""
        self._buffer += text
        return self._step(final=False)

    def finish(self) -> tuple[str, str]:
        """Everything still held back."""
        return self._step(final=True)

    def _step(self, *, final: bool) -> tuple[str, str]:
        reasoning, content = "", ""
        if self._state == "start":
            head = self._buffer.lstrip()
            if head.startswith(THINK_START):
                self._buffer = head[len(THINK_START) :]
                self._state, self._fresh = "reasoning", True
            elif (THINK_START.startswith(head) or not head) and not final:
                return "", ""  # may still open the reasoning
            else:
                self._state = "content"
        if self._state == "reasoning":
            end = self._buffer.find(THINK_END)
            if end >= 0:
                reasoning = self._reasoning(self._buffer[:end])
                self._pending_ws = ""
                self._buffer = self._buffer[end + len(THINK_END) :].lstrip()
                self._state = "after"
            else:
                keep = 0 if final else held_back(self._buffer, (THINK_END,))
                reasoning = self._reasoning(self._buffer[: len(self._buffer) - keep])
                self._buffer = self._buffer[len(self._buffer) - keep :]
                return reasoning, ""
        if self._state == "after":  # whitespace after the end marker is dropped
            self._buffer = self._buffer.lstrip()
            if not self._buffer and not final:
                return reasoning, ""
            self._state = "content"
        content, self._buffer = self._buffer, ""
        return reasoning, content

    def _reasoning(self, text: str) -> str:
        if self._fresh:
            text = text.lstrip()
            if not text:
                return ""
            self._fresh = False
        body = text.rstrip()
        if not body:
            self._pending_ws += text
            return ""
        out = self._pending_ws + body
        self._pending_ws = text[len(body) :]
        return out


def split_reasoning(text: str, *, in_reasoning: bool) -> tuple[str, str]:
    """A whole generation as (reasoning, content): the same as streaming it in any chunks."""
    stream = ThinkStream(in_reasoning=in_reasoning)
    r1, c1 = stream.feed(text)
    r2, c2 = stream.finish()
    return r1 + r2, c1 + c2


def detect_reasoning_parser(*, chat_template: str | None, tokens: Iterable[str]) -> str | None:
    """`think` when the model's template or vocabulary knows `</think>`, else None (no reasoning
    parser: the output is all content)."""
    if THINK_END in (chat_template or "") or THINK_END in set(tokens):
        return THINK
    return None
