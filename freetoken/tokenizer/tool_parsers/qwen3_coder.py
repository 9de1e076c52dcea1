"""Qwen3-Coder / Qwen3.5 tool calls: XML-like blocks whose parameter values are raw text.

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

Owns that format (Qwen3-Coder's and Qwen3.5's chat templates render tools and earlier calls this
way): the parser, the rendering of earlier calls, a tool prompt for templates that render no tools
and the forced-call grammar. The model writes a value as text, one newline on each side (dropped);
the tool's schema types it (typed_arguments.py): a string parameter is the text as written, and
streams while it is written; numbers, booleans, objects and arrays are read as JSON once the
value ends. A `<function=...>` without the `<tool_call>` around it is read too (models drop it). A
block whose function is not a known tool is released as the text it was; once a known function was
named the call stands, with the parameters written so far, whatever follows. Results go back in
`<tool_response>` blocks (the template's `tool` role).
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
from freetoken.tokenizer.tool_parsers.typed_arguments import pairs_grammar, raw_pairs, text_until

BLOCK_START, BLOCK_END = "<tool_call>", "</tool_call>"
FUNCTION, FUNCTION_END = "<function=", "</function>"
PARAMETER, PARAMETER_END = "<parameter=", "</parameter>"
VALUE_ENDS = (PARAMETER_END, PARAMETER, FUNCTION_END)  # a value ends at its end tag, or where the model went on
_NAME = re.compile(r"[^\s<>]+")


class Qwen3CoderStream(PairedArgumentsStream):
    """States: `text` (content, looking for a block), `block` (after `<tool_call>`, before the
    function), `head` (the function's name), `params` (between parameters), `value` (a parameter's
    text), `after` (past `</function>`, where `</tool_call>` may follow)."""

    OPENERS: ClassVar[Mapping[str, str]] = {BLOCK_START: "block", FUNCTION: "head"}
    UNDECIDED = ("block", "head")

    def __init__(self, parser: Qwen3CoderParser) -> None:
        super().__init__(parser)
        self._in_block = False  # the open call sits in a `<tool_call>` block (set by each opening)
        self._fresh = False  # at the start of a value: its leading newline is dropped

    def _open(self, marker: str) -> None:
        self._in_block = marker == BLOCK_START
        super()._open(marker)

    def _block(self, out: StreamDelta, final: bool) -> bool:
        body = self._buffer.lstrip()
        if body.startswith(FUNCTION):
            self._opened += self._buffer[: len(self._buffer) - len(body)] + FUNCTION
            self._buffer, self._state = body[len(FUNCTION) :], "head"
            return True
        if FUNCTION.startswith(body) and not final:
            return False
        return self._not_a_call(out)

    def _head(self, out: StreamDelta, final: bool) -> bool:
        j = self._buffer.find(">")
        if j < 0:
            if final or not _NAME.fullmatch(self._buffer or "x"):
                return self._not_a_call(out)
            return False
        name = self._buffer[:j]
        if not _NAME.fullmatch(name) or not self._known(name):
            return self._not_a_call(out)
        self._announce(name, out)
        self._buffer, self._state = self._buffer[j + 1 :], "params"
        return True

    def _params(self, out: StreamDelta, final: bool) -> bool:
        body = self._buffer.lstrip()
        if body.startswith(PARAMETER):
            j = body.find(">", len(PARAMETER))
            if j < 0:
                if final:
                    self._end_call(out, "after")
                    self._buffer = ""
                return False
            self._emit(self._writer.key(body[len(PARAMETER) : j].strip()), out)
            self._buffer, self._state, self._fresh = body[j + 1 :], "value", True
            return True
        if body.startswith(FUNCTION_END):
            self._buffer = body[len(FUNCTION_END) :]
            self._end_call(out, "after")
            return True
        if (PARAMETER.startswith(body) or FUNCTION_END.startswith(body)) and not final:
            self._buffer = body
            return False
        self._buffer = body  # anything else ends the call; it is read as text again
        self._end_call(out, "after")
        return True

    def _value(self, out: StreamDelta, final: bool) -> bool:
        if self._fresh:
            if not self._buffer and not final:
                return False
            self._buffer = self._buffer.removeprefix("\n")
            self._fresh = False
        hits = [(i, m) for m in VALUE_ENDS if (i := self._buffer.find(m)) >= 0]
        if hits:
            i, marker = min(hits)
            text = self._buffer[:i]
            self._emit(self._writer.value(text.removesuffix("\n")), out)
            self._emit(self._writer.end_value(), out)
            self._buffer = self._buffer[i + (len(marker) if marker == PARAMETER_END else 0) :]
            self._state = "params"
            return True
        if final:
            text = self._buffer
            self._emit(self._writer.value(text.removesuffix("\n")), out)
            self._buffer = ""
            self._end_call(out, "after")
            return False
        keep = held_back(self._buffer, VALUE_ENDS)
        ready = self._buffer[: len(self._buffer) - keep]
        ready = ready.removesuffix("\n")  # may be the newline before the end tag
        self._emit(self._writer.value(ready), out)
        self._buffer = self._buffer[len(ready) :]
        return False

    def _after(self, out: StreamDelta, final: bool) -> bool:
        if not self._in_block:
            self._state = "text"
            return True
        body = self._buffer.lstrip()
        if body.startswith(BLOCK_END):
            self._buffer = body[len(BLOCK_END) :]
        elif BLOCK_END.startswith(body) and not final:
            return False
        self._in_block, self._state = False, "text"
        return True


class Qwen3CoderParser(ToolParser):
    name = "qwen3_coder"
    markers = (BLOCK_START, BLOCK_END)

    def stream(self) -> ToolCallStream:
        return Qwen3CoderStream(self)

    def tool_prompt(self, tools: Sequence[Mapping[str, Any]], *, parallel: bool) -> str:
        how_many = "You may call several functions, one block each." if parallel else "Call at most one function."
        return (
            "# Tools\n\nYou have access to the following functions:\n\n"
            f"<tools>\n{tools_json(tools)}\n</tools>\n\n"
            "To call a function, reply in this format, one parameter block per argument, with the value as plain "
            "text (JSON for numbers, booleans, objects and arrays):\n"
            f"{BLOCK_START}\n{FUNCTION}<function name>>\n{PARAMETER}<parameter name>>\n<value>\n{PARAMETER_END}\n"
            f"{FUNCTION_END}\n{BLOCK_END}\n{how_many}"
        )

    def forced_grammar(self, tools: Sequence[Mapping[str, Any]]) -> str:
        """One block of one of `tools`: its declared parameters in schema order (the required
        ones always, the others optional), each value as its schema allows: a string as any text
        without the format's tags, anything else as compact JSON."""
        specials = self.marker_tokens

        def pair(key: str, value: str, is_string: bool) -> str:
            head = json.dumps(f"{PARAMETER}{key}>\n")
            end = "" if is_string else " " + json.dumps("\n" + PARAMETER_END)
            return f"{head} {value}{end} " + json.dumps("\n")

        start = [
            lark_text(f"{BLOCK_START}\n{FUNCTION}", specials),
            "call",
            lark_text(f"{FUNCTION_END}\n{BLOCK_END}", specials),
        ]
        return pairs_grammar(
            tools,
            start=" ".join(start),
            name=lambda name: json.dumps(f"{name}>\n"),
            pair=pair,
            string_value=text_until("\n" + PARAMETER_END, VALUE_ENDS),
        )

    def format_calls(self, calls: Sequence[ToolCall]) -> str:
        blocks = []
        for c in calls:
            params = "".join(f"{PARAMETER}{k}>\n{v}\n{PARAMETER_END}\n" for k, v in raw_pairs(c.arguments))
            blocks.append(f"{BLOCK_START}\n{FUNCTION}{c.name}>\n{params}{FUNCTION_END}\n{BLOCK_END}")
        return "\n".join(blocks)
