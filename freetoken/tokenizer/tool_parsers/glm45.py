"""GLM-4.5 / 4.6 / 4.7 tool calls: the function's name, then key / value tag pairs with raw values.

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    <arg_key>days</arg_key>
    <arg_value>3</arg_value>
    </tool_call>

Owns that format (GLM-4.5's and later chat templates render tools and earlier calls this way): the
parser, the rendering of earlier calls, a tool prompt for templates that render no tools and the
forced-call grammar. A value is typed by the tool's schema (typed_arguments.py): a string parameter
is the text between the tags, and streams while it is written; numbers, booleans, objects and
arrays are read as JSON once the value ends. Whitespace between the tags may be newlines or spaces.
A block whose name is not a known tool is released as the text it was; once a known tool was named
the call stands, with the arguments written so far, whatever follows. Results go back in
`<tool_response>` blocks (the template's `tool` role, after `<|observation|>`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from freetoken.tokenizer.detokenizer import held_back
from freetoken.tokenizer.tool_parsers.base import StreamDelta, ToolCall, ToolCallStream, ToolParser, tools_json
from freetoken.tokenizer.tool_parsers.grammar import lark_text
from freetoken.tokenizer.tool_parsers.marked_stream import PairedArgumentsStream
from freetoken.tokenizer.tool_parsers.typed_arguments import pairs_grammar, raw_pairs, text_until, text_without

START, END = "<tool_call>", "</tool_call>"
KEY, KEY_END = "<arg_key>", "</arg_key>"
VALUE, VALUE_END = "<arg_value>", "</arg_value>"
_NAME = re.compile(r"[^\s<>]+")


class Glm45Stream(PairedArgumentsStream):
    """States: `text` (content, looking for `<tool_call>`), `head` (the tool's name), `pairs`
    (between pairs, or the block's end), `key` (inside `<arg_key>`), `opening` (between the key and
    `<arg_value>`), `value` (the value's text)."""

    OPENERS: ClassVar[Mapping[str, str]] = {START: "head"}
    UNDECIDED = ("head",)

    def _head(self, out: StreamDelta, final: bool) -> bool:
        body = self._buffer.lstrip()
        m = _NAME.match(body)
        if m is None or m.end() == len(body):  # no name yet, or it may go on
            if not final and (m is not None or not body):
                return False
            if m is None:
                return self._not_a_call(out)
        name = m.group()
        if not self._known(name):
            return self._not_a_call(out)
        self._announce(name, out)
        self._buffer, self._state = body[m.end() :], "pairs"
        return True

    def _pairs(self, out: StreamDelta, final: bool) -> bool:
        body = self._buffer.lstrip()
        for marker, state in ((KEY, "key"), (END, "text")):
            if body.startswith(marker):
                self._buffer = body[len(marker) :]
                if state == "text":
                    self._end_call(out)
                self._state = state
                return True
        if (KEY.startswith(body) or END.startswith(body)) and not final:
            self._buffer = body
            return False
        self._buffer = body  # anything else ends the call; it is read as text again
        self._end_call(out)
        return True

    def _key(self, out: StreamDelta, final: bool) -> bool:
        j = self._buffer.find(KEY_END)
        if j < 0:
            if final:
                self._buffer = ""
                self._end_call(out)
            return False
        self._emit(self._writer.key(self._buffer[:j].strip()), out)
        self._buffer, self._state = self._buffer[j + len(KEY_END) :], "opening"
        return True

    def _opening(self, out: StreamDelta, final: bool) -> bool:
        body = self._buffer.lstrip()
        if body.startswith(VALUE):
            self._buffer, self._state = body[len(VALUE) :], "value"
            return True
        if VALUE.startswith(body) and not final:
            self._buffer = body
            return False
        self._emit(self._writer.end_value(), out)  # a key without a value: an empty one
        self._buffer, self._state = body, "pairs"
        return True

    def _value(self, out: StreamDelta, final: bool) -> bool:
        hits = [(i, m) for m in (VALUE_END, END) if (i := self._buffer.find(m)) >= 0]
        if hits:
            i, marker = min(hits)
            self._emit(self._writer.value(self._buffer[:i]) + self._writer.end_value(), out)
            self._buffer = self._buffer[i + (len(marker) if marker == VALUE_END else 0) :]
            self._state = "pairs"
            return True
        keep = 0 if final else held_back(self._buffer, (VALUE_END, END))
        self._emit(self._writer.value(self._buffer[: len(self._buffer) - keep]), out)
        self._buffer = self._buffer[len(self._buffer) - keep :]
        if final:
            self._end_call(out)
        return False


class Glm45Parser(ToolParser):
    name = "glm45"
    markers = (START, END, KEY, KEY_END, VALUE, VALUE_END)

    def stream(self) -> ToolCallStream:
        return Glm45Stream(self)

    def tool_prompt(self, tools: Sequence[Mapping[str, Any]], *, parallel: bool) -> str:
        how_many = "You may call several functions, one block each." if parallel else "Call at most one function."
        return (
            "# Tools\n\nYou may call functions to assist with the user query. The function signatures are listed "
            f"within <tools></tools>:\n<tools>\n{tools_json(tools)}\n</tools>\n\n"
            "For each function call, output the function name and its arguments in this format (a value as "
            "plain text, JSON for numbers, booleans, objects and arrays):\n"
            f"{START}<function name>\n{KEY}<argument name>{KEY_END}\n{VALUE}<value>{VALUE_END}\n{END}\n{how_many}"
        )

    def forced_grammar(self, tools: Sequence[Mapping[str, Any]]) -> str:
        """One block of one of `tools`: its declared arguments in schema order (the required ones
        always, the others optional), a string value as any text without the format's tags,
        anything else as compact JSON. Markers that are special tokens are written by id."""
        specials = self.marker_tokens
        # The string terminal ends with `</arg_value>`, unless that is a token of its own (a
        # lexeme of text cannot hold it): then the text stops before it and the token follows.
        if VALUE_END in specials:
            terminal, closes = text_without((VALUE_END, END)), False
        else:
            terminal, closes = text_until(VALUE_END, (VALUE_END, END)), True

        def pair(key: str, value: str, is_string: bool) -> str:
            head = lark_text(f"\n{KEY}{key}{KEY_END}\n{VALUE}", specials)
            end = "" if is_string and closes else " " + lark_text(VALUE_END, specials)
            return f"{head} {value}{end}"

        return pairs_grammar(
            tools,
            start=" ".join([lark_text(START, specials), "call", lark_text("\n" + END, specials)]),
            name=json.dumps,
            pair=pair,
            string_value=terminal,
        )

    def format_calls(self, calls: Sequence[ToolCall]) -> str:
        blocks = []
        for c in calls:
            pairs = "".join(f"{KEY}{k}{KEY_END}\n{VALUE}{v}{VALUE_END}\n" for k, v in raw_pairs(c.arguments))
            blocks.append(f"{START}{c.name}\n{pairs}{END}")
        return "\n".join(blocks)
