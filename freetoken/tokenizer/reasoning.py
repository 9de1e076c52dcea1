"""Reasoning in marked blocks: splitting a generation into its reasoning and the rest, incrementally.

Three markups: `think`, `<think>...</think>` (Qwen 3, DeepSeek R1 and their distills), `gemma4`,
`<|channel>thought\n...<channel|>` (Gemma 4), and `mistral`, `[THINK]...[/THINK]` (Magistral
Small 2509 and later, whose markers are control tokens of its vocabulary). Owns `ThinkStream` (feed text deltas, get the
reasoning and the content they make certain; text that may still be the start of a marker is held
back), `reasoning_stream` (the stream for a parser name), `REASONING_PARSERS` (the names
`--reasoning-parser` accepts) and `detect_reasoning_parser` (the model's template or vocabulary
names the end marker). The reasoning may open in the prompt (DeepSeek R1's template ends its generation
prompt with `<think>`), so a stream can start inside it. An unclosed reasoning block (the output
was cut) is all reasoning. Harmony's channels are the Harmony tool parser's, not this module's.
Tool calls inside the content are the tool parser's to find; this module knows no tools and no HTTP.
"""

from __future__ import annotations

from collections.abc import Iterable

from freetoken.tokenizer.detokenizer import held_back

THINK_START, THINK_END = "<think>", "</think>"
GEMMA4_START, GEMMA4_END = "<|channel>thought", "<channel|>"
MISTRAL_START, MISTRAL_END = "[THINK]", "[/THINK]"
THINK, GEMMA4, MISTRAL = "think", "gemma4", "mistral"
MARKERS = {THINK: (THINK_START, THINK_END), GEMMA4: (GEMMA4_START, GEMMA4_END), MISTRAL: (MISTRAL_START, MISTRAL_END)}
REASONING_PARSERS = (THINK, GEMMA4, MISTRAL, "none")


class ThinkStream:
    """One generation's split, the reasoning between `start` and `end`. Whitespace right inside
    the markers and right after the end is dropped."""

    def __init__(self, *, in_reasoning: bool, start: str = THINK_START, end: str = THINK_END) -> None:
        self._start, self._end = start, end
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
            if head.startswith(self._start):
                self._buffer = head[len(self._start) :]
                self._state, self._fresh = "reasoning", True
            elif (self._start.startswith(head) or not head) and not final:
                return "", ""  # may still open the reasoning
            else:
                self._state = "content"
        if self._state == "reasoning":
            end = self._buffer.find(self._end)
            if end >= 0:
                reasoning = self._reasoning(self._buffer[:end])
                self._pending_ws = ""
                self._buffer = self._buffer[end + len(self._end) :].lstrip()
                self._state = "after"
            else:
                keep = 0 if final else held_back(self._buffer, (self._end,))
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


def reasoning_stream(name: str, *, in_reasoning: bool) -> ThinkStream:
    """The stream of reasoning parser `name` (one of `MARKERS`)."""
    start, end = MARKERS[name]
    return ThinkStream(in_reasoning=in_reasoning, start=start, end=end)


def split_reasoning(text: str, *, in_reasoning: bool, name: str = THINK) -> tuple[str, str]:
    """A whole generation as (reasoning, content): the same as streaming it in any chunks."""
    stream = reasoning_stream(name, in_reasoning=in_reasoning)
    r1, c1 = stream.feed(text)
    r2, c2 = stream.finish()
    return r1 + r2, c1 + c2


def detect_reasoning_parser(*, chat_template: str | None, tokens: Iterable[str]) -> str | None:
    """`gemma4` when the model's template or vocabulary knows `<channel|>`, `mistral` when it knows
    `[/THINK]`, `think` when it knows `</think>`, else None (no reasoning parser: the output is
    all content). Magistral 2509's template names `[THINK]` in its default system prompt, and its
    vocabulary has both as control tokens; 2506's wrote `<think>` as text (`think`)."""
    template, vocab = chat_template or "", set(tokens)
    for name in (GEMMA4, MISTRAL, THINK):
        end = MARKERS[name][1]
        if end in template or end in vocab:
            return name
    return None
