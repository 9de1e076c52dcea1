"""Gemma 4 tool calls: `<|tool_call>call:NAME{key:value,...}<tool_call|>`, in Gemma's own value
syntax, turned into OpenAI calls whose JSON arguments stream while they are written.

Gemma 4's chat template renders tools itself (`<|tool>...<tool|>` in the system turn) and writes
earlier calls and results the same way, so this format is what the model produces. Its template's
`format_argument` writes a value as: a string between `<|"|>` quotes (taken literally, nothing is
escaped), `true`/`false`, a mapping `{key:value,...}` with bare keys, a list `[value,...]`, anything
else bare (numbers). `ArgumentsJson` translates that to JSON text piece by piece (JSON-quoted keys
and strings are read too, as models sometimes write them); a bare word that is no JSON literal
becomes a string. A block whose head names an unknown tool, or is no `call:NAME{`, is released as
the text it was; once a known tool's head was read the call stands, with the arguments written so
far, whatever follows. The `<|tool_response>` the model writes after its calls (handing over to
the tool) is dropped. Results go back as `<|tool_response>response:NAME{value:...}<tool_response|>`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from freetoken.tokenizer.detokenizer import held_back
from freetoken.tokenizer.tool_parsers.base import (
    CallGapContent,
    StreamDelta,
    ToolCall,
    ToolCallDelta,
    ToolCallStream,
    ToolParser,
    new_call_id,
    tools_json,
)
from freetoken.tokenizer.tool_parsers.grammar import ANY_OBJECT, COMPACT_JSON

START, END = "<|tool_call>", "<tool_call|>"
QUOTE = '<|"|>'
CALL = "call:"
RESPONSE_START, RESPONSE_END = "<|tool_response>", "<tool_response|>"
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*")
_JSON_NUMBER = re.compile(r"-?(0|[1-9]\d*)(\.\d+)?([eE][+-]?\d+)?")
_BARE = {"true": "true", "false": "false", "null": "null", "True": "true", "False": "false", "None": "null"}


class ArgumentsJson:
    """Gemma 4 argument text (starting at the arguments' `{`) -> JSON text, fed piece by piece.
    `feed` returns the JSON made certain so far; `done` once the outer object has closed (the text
    after it is `rest`)."""

    def __init__(self) -> None:
        self._pending = ""  # input not yet translated (a possible quote marker, a bare word)
        self._stack: list[str] = []  # "{" / "[" of the open containers
        self._string: str | None = None  # the quote of the open string: QUOTE or '"'
        self._escape = False  # in a JSON-quoted string, after a backslash
        self._key = False  # the open string, or bare word, is an object key
        self.done = False
        self.rest = ""

    @property
    def in_string(self) -> bool:
        return self._string is not None

    def feed(self, text: str, *, final: bool = False) -> str:
        self._pending += text
        out: list[str] = []
        i, s = 0, self._pending
        while i < len(s) and not self.done:
            if self._string is not None:
                j = self._in_string(s, i, out, final=final)
                if j is None:
                    break
                i = j
                continue
            ch = s[i]
            if s.startswith(QUOTE, i):
                self._string, i = QUOTE, i + len(QUOTE)
                out.append('"')
            elif QUOTE.startswith(s[i:]) and not final:
                break  # may be a quote marker
            elif ch == '"':
                self._string, i = '"', i + 1
                out.append('"')
            elif ch in "{[":
                self._stack.append(ch)
                self._key = ch == "{"
                out.append(ch)
                i += 1
            elif ch in "}]":
                if self._stack:
                    self._stack.pop()
                out.append(ch)
                i += 1
                if not self._stack:
                    self.done = True
            elif ch == ",":
                self._key = bool(self._stack) and self._stack[-1] == "{"
                out.append(ch)
                i += 1
            elif ch == ":":
                self._key = False
                out.append(ch)
                i += 1
            elif ch in " \t\r\n":
                i += 1
            else:
                j = i
                while j < len(s) and s[j] not in ",:}]" and not s.startswith(QUOTE, j):
                    j += 1
                if j == len(s) and not final:
                    break  # the word may go on
                out.append(self._bare(s[i:j].strip()))
                i = j
        self._pending = s[i:]
        if self.done:
            self.rest, self._pending = self._pending, ""
        return "".join(out)

    def _in_string(self, s: str, i: int, out: list[str], *, final: bool) -> int | None:
        """Past the open string's text in `s` from `i` (None: nothing more can be decided)."""
        if self._string == QUOTE:
            j = s.find(QUOTE, i)
            if j < 0:
                keep = 0 if final else held_back(s[i:], (QUOTE,))
                end = len(s) - keep
                out.append(json.dumps(s[i:end], ensure_ascii=False)[1:-1])
                return None if end == i else end
            out.append(json.dumps(s[i:j], ensure_ascii=False)[1:-1] + '"')
            self._string = None
            return j + len(QUOTE)
        j = i
        while j < len(s):  # a JSON string: copied as written
            ch = s[j]
            j += 1
            if self._escape:
                self._escape = False
            elif ch == "\\":
                self._escape = True
            elif ch == '"':
                self._string = None
                break
        out.append(s[i:j])
        return j

    def _bare(self, word: str) -> str:
        if self._key:
            return json.dumps(word, ensure_ascii=False)
        if word in _BARE:
            return _BARE[word]
        if _JSON_NUMBER.fullmatch(word):
            return word
        return json.dumps(word, ensure_ascii=False)


class Gemma4Stream(CallGapContent, ToolCallStream):
    """Text outside `<|tool_call>` blocks is content (a possible marker start held back); a block's
    head `call:NAME{` announces the call, then its arguments stream as JSON. Whitespace between
    content and a call is dropped."""

    def __init__(self, tool_names: frozenset[str] | None) -> None:
        self._tool_names = tool_names
        self._buffer = ""
        self._in_block = False
        self._args: ArgumentsJson | None = None  # the open call's translator, once announced
        self._num_calls = 0
        self._after_call = False
        self._pending_ws = ""

    def _step(self, out: StreamDelta, *, final: bool) -> bool:
        if self._args is not None:
            return self._stream_arguments(out, final=final)
        if self._in_block:
            return self._read_head(out, final=final)
        hits = [(i, m) for m in (START, RESPONSE_START) if (i := self._buffer.find(m)) >= 0]
        if hits:
            i, marker = min(hits)
            self._content(self._buffer[:i], out)
            self._buffer = self._buffer[i + len(marker) :]
            self._in_block = marker == START
            return True
        keep = 0 if final else held_back(self._buffer, (START, RESPONSE_START))
        self._content(self._buffer[: len(self._buffer) - keep], out)
        self._buffer = self._buffer[len(self._buffer) - keep :]
        return False

    def _read_head(self, out: StreamDelta, *, final: bool) -> bool:
        body = self._buffer.lstrip()
        head = _head(body, self._tool_names)
        if head is None and not final:
            return False
        if not head:  # not a call of a known tool: the block is text up to its end marker
            j = self._buffer.find(END)
            if j < 0 and not final:
                return False
            upto = len(self._buffer) if j < 0 else j + len(END)
            self._content(START + self._buffer[:upto], out)
            self._buffer, self._in_block = self._buffer[upto:], False
            return True
        name, offset = head
        self._pending_ws = ""
        out.tool_calls.append(ToolCallDelta(self._num_calls, ToolCall(new_call_id(), name, "")))
        self._args = ArgumentsJson()
        self._buffer = body[offset:]
        return True

    def _stream_arguments(self, out: StreamDelta, *, final: bool) -> bool:
        args = self._args
        assert args is not None
        if not args.done:
            j = self._buffer.find(END)
            upto = j if j >= 0 else len(self._buffer) - (0 if final else held_back(self._buffer, (END,)))
            text, self._buffer = self._buffer[:upto], self._buffer[upto:]
            self._emit(args.feed(text, final=final and j < 0), out)
            if args.done:
                self._buffer = args.rest + self._buffer
            elif j < 0:
                return False  # cut off here at the end: the call stands (`_flush`)
            elif args.in_string:  # the marker is text inside a string of the arguments
                self._emit(args.feed(END), out)
                self._buffer = self._buffer[len(END) :]
                return True
            else:  # the block closed before its arguments did: the call ends there
                self._emit(args.feed("", final=True), out)
                self._buffer = self._buffer[len(END) :]
                self._end_call()
                return True
        j = self._buffer.find(END)
        if j < 0:
            self._buffer = "" if final else self._buffer[len(self._buffer) - held_back(self._buffer, (END,)) :]
            return False
        self._buffer = self._buffer[j + len(END) :]
        self._end_call()
        return True

    def _emit(self, fragment: str, out: StreamDelta) -> None:
        if fragment:
            out.tool_calls.append(ToolCallDelta(self._num_calls, ToolCall("", "", fragment), first=False))

    def _end_call(self) -> None:
        self._args, self._in_block = None, False
        self._num_calls += 1
        self._after_call = True

    def _flush(self, out: StreamDelta) -> None:
        if self._args is not None:  # cut off inside an announced call: it stays a call
            self._end_call()
        elif self._in_block:
            self._content(START + self._buffer, out)
            self._in_block = False
        elif self._buffer:
            self._content(self._buffer, out)
        self._buffer = ""
        if not self._after_call:
            out.content += self._pending_ws
        self._pending_ws = ""


def _head(body: str, tool_names: frozenset[str] | None) -> tuple[str, int] | bool | None:
    """`call:NAME{` at the start of `body`: (NAME, offset of its `{`) for a known tool, False when
    the body cannot be that, None while it may still become it."""
    if len(body) < len(CALL):
        return None if CALL.startswith(body) else False
    if not body.startswith(CALL):
        return False
    m = _NAME.match(body, len(CALL))
    if m is None:
        return None if len(body) == len(CALL) else False
    if m.end() == len(body):
        return None
    if body[m.end()] != "{":
        return False
    name = m.group()
    if tool_names is not None and name not in tool_names:
        return False
    return name, m.end()


def gemma_value(value: object) -> str:
    """A JSON value in Gemma 4's argument syntax (as its template's `format_argument` writes it)."""
    if isinstance(value, str):
        return QUOTE + value + QUOTE
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{gemma_value(v)}" for k, v in sorted(value.items())) + "}"
    if isinstance(value, list):
        return "[" + ",".join(gemma_value(v) for v in value) + "]"
    return "null" if value is None else json.dumps(value)


class Gemma4Parser(ToolParser):
    name = "gemma4"
    needs_special_tokens = True  # the markers are added tokens a Hugging Face tokenizer may call special

    def stream(self) -> ToolCallStream:
        return Gemma4Stream(self.tool_names)

    def tool_prompt(self, tools: Sequence[Mapping[str, Any]], *, parallel: bool) -> str:
        how_many = "You may call several functions, one block each." if parallel else "Call at most one function."
        return (
            "You have access to the functions below, described as JSON schemas:\n"
            f"{tools_json(tools)}\n\n"
            f"To call a function, write {START}call:<function name>{{<arguments>}}{END}, the arguments as "
            f"key:value pairs separated by commas, strings between {QUOTE} marks, for example "
            f"{START}call:get_weather{{city:{QUOTE}Paris{QUOTE}}}{END}. {how_many}"
        )

    def forced_grammar(self, tools: Sequence[Mapping[str, Any]]) -> str:
        """The call with its arguments as compact JSON (which this parser reads too): one
        alternative per tool, its name then an object matching its parameters. The markers are
        written bare, so llguidance takes them as the vocabulary's tokens of that name."""
        rules = []
        options = []
        for k, tool in enumerate(tools):
            fn = tool.get("function", tool)
            schema = {**(fn.get("parameters") or ANY_OBJECT), "x-guidance": COMPACT_JSON}
            rules.append(f"args{k}: %json {json.dumps(schema)}")
            options.append(f"{json.dumps(str(fn.get('name')))} args{k}")
        return f"start: {START} {json.dumps(CALL)} call {END}\ncall: {' | '.join(options)}\n" + "\n".join(rules) + "\n"

    def format_calls(self, calls: Sequence[ToolCall]) -> str:
        parts = []
        for c in calls:
            try:
                args = json.loads(c.arguments)
            except ValueError:
                args = {}
            body = ",".join(f"{k}:{gemma_value(v)}" for k, v in sorted(args.items())) if isinstance(args, dict) else ""
            parts.append(f"{START}{CALL}{c.name}{{{body}}}{END}")
        return "".join(parts)

    def format_result(self, content: str, name: str | None) -> str:
        return f"{RESPONSE_START}response:{name or 'unknown'}{{value:{QUOTE}{content}{QUOTE}}}{RESPONSE_END}"
