"""Mistral tool calls: `[TOOL_CALLS]` then either a JSON list of calls (Mistral 7B v0.3, Nemo) or,
in the newer tokenizers (Mistral Small 3.2, Devstral, Magistral, Ministral 3), the function's name
and its JSON arguments, one marker per call:

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]search[ARGS]{"q": "x"}

Owns that format: the parser, the rendering of earlier calls (the newer form), a tool prompt for
templates that render no tools and the forced-call grammar. A call is announced once its name is
read (in the list form: once its object names the tool before its arguments, as the models and the
grammar write it; an object in another order is read whole) and its arguments stream while they are
written. `[CALL_ID]id` between the name and `[ARGS]` (Mistral Small 3.2's history form) is skipped.
A call of an unknown tool, or text that is neither form, is released as the text it was; once a
known tool was named the call stands, with the arguments written so far, whatever follows. The
markers are control tokens of Mistral's vocabularies, so decoding keeps special tokens while tools
are in play (server/core/tool_calling.py) and a forced grammar names them by id. Mistral's
templates take only 9-character ids: `template_call_id` maps ours onto such ids for them.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from freetoken.tokenizer.detokenizer import held_back
from freetoken.tokenizer.tool_parsers.base import (
    StreamDelta,
    ToolCall,
    ToolCallStream,
    ToolParser,
    call_from_object,
    tools_json,
)
from freetoken.tokenizer.tool_parsers.blocks import JsonValueEnd, object_head
from freetoken.tokenizer.tool_parsers.grammar import ANY_OBJECT, COMPACT_JSON, lark_text
from freetoken.tokenizer.tool_parsers.marked_stream import MarkedCallStream

TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
_NAME = re.compile(r"[A-Za-z0-9_.\-]+")


class MistralStream(MarkedCallStream):
    """States: `text` (content, looking for `[TOOL_CALLS]`), `form` (which form follows the
    marker), `name` (the newer form's name, up to `[ARGS]`), `args` (a call's arguments object
    streaming), `list` (the list form, between its objects), `object` (a list object's head),
    `rest` (the rest of a list object after its arguments)."""

    OPENERS: ClassVar[Mapping[str, str]] = {TOOL_CALLS: "form"}
    UNDECIDED = ("form", "name")

    def __init__(self, tool_names: frozenset[str] | None) -> None:
        super().__init__(tool_names)
        self._scanner: JsonValueEnd | None = None  # the streaming arguments, or a list object's rest
        self._in_list = False  # in the list form
        self._in_object = False  # the streaming call's arguments sit in a call object
        self._started = False  # the streaming arguments object has begun

    def _form(self, out: StreamDelta, final: bool) -> bool:
        body = self._buffer.lstrip()
        if not body:
            if final:
                return self._not_a_call(out)
            return False
        if body[0] == "[":
            self._buffer, self._state, self._in_list = body[1:], "list", True
        elif body[0] == "{":
            self._buffer, self._state, self._in_list = body, "object", False
        else:
            self._buffer, self._state = body, "name"
        return True

    def _name(self, out: StreamDelta, final: bool) -> bool:
        i = self._buffer.find(ARGS)
        head = self._buffer if i < 0 else self._buffer[:i]
        name, has_id, _ = head.partition(CALL_ID)
        if i < 0:
            if not has_id:
                name = name[: len(name) - held_back(name, (ARGS, CALL_ID))]
            if final or not (not name or _NAME.fullmatch(name)) or len(head) > 256:
                return self._not_a_call(out)
            return False
        if not _NAME.fullmatch(name) or not self._known(name):
            return self._not_a_call(out)
        self._announce(name, out)
        self._buffer, self._state, self._in_object = self._buffer[i + len(ARGS) :], "args", False
        return True

    def _announce(self, name: str, out: StreamDelta) -> None:
        super()._announce(name, out)
        self._scanner, self._started = JsonValueEnd(), False

    def _args(self, out: StreamDelta, final: bool) -> bool:
        scanner = self._scanner
        assert scanner is not None
        if not self._started:
            body = self._buffer.lstrip()
            if not body:
                if final:
                    self._emit("{}", out)
                    self._end_call(out)
                return False
            if body[0] != "{":  # no arguments object: the call has none
                self._emit("{}", out)
                self._buffer = body
                self._end_call(out)
                return True
            self._buffer = body
        end = scanner.scan(self._buffer)
        cut = len(self._buffer) if end is None else end
        self._emit(self._buffer[:cut], out)
        self._buffer = self._buffer[cut:]
        self._started = True
        if end is None:
            if final:
                self._end_call(out)
            return False
        if self._in_object:
            self._scanner = JsonValueEnd()
            self._scanner.scan("{")  # inside the call object: its closing brace ends it
            self._state = "rest"
        else:
            self._end_call(out)
        return True

    def _list(self, out: StreamDelta, final: bool) -> bool:
        body = self._buffer.lstrip()
        if not body:
            if final:
                self._state = "text"
            return False
        if body[0] == ",":
            self._buffer = body[1:]
            return True
        if body[0] == "]":
            self._buffer, self._state = body[1:], "text"
            return True
        if body[0] == "{":
            self._buffer, self._state = body, "object"
            return True
        self._buffer, self._state = body, "text"  # not a list of calls after all: text again
        return True

    def _object(self, out: StreamDelta, final: bool) -> bool:
        head = object_head(self._buffer, ("name", "arguments"), self._names)
        if head is None and not final:
            return False
        if head:
            name, offset = head
            self._announce(name, out)
            self._buffer, self._state, self._in_object = self._buffer[offset:], "args", True
            return True
        # Not a streamable call: the whole object, read as one call when it is one.
        scanner = JsonValueEnd()
        end = scanner.scan(self._buffer)
        if end is None and not final:
            return False
        text = self._buffer if end is None else self._buffer[:end]
        try:
            call = call_from_object(json.loads(text), self._names)
        except ValueError:
            call = None
        self._buffer = self._buffer[len(text) :]
        if call is None:
            return self._not_a_call(out, TOOL_CALLS + ("[" if self._in_list else "") + text)
        self._begin_call(call, out)  # a call read whole: announced and ended at once
        self._end_call(out, "list" if self._in_list else "text")
        return True

    def _rest(self, out: StreamDelta, final: bool) -> bool:
        scanner = self._scanner
        assert scanner is not None
        end = scanner.scan(self._buffer)
        if end is None:
            self._buffer = ""  # other keys of the call object (an id): dropped
            if final:
                self._end_call(out)
            return False
        self._buffer = self._buffer[end:]
        self._end_call(out, "list" if self._in_list else "text")
        return True

    @property
    def _in_call(self) -> bool:
        return self._scanner is not None

    def _close_call(self, out: StreamDelta) -> None:
        self._scanner, self._started = None, False


class MistralParser(ToolParser):
    name = "mistral"
    markers = (TOOL_CALLS, ARGS, CALL_ID)

    def stream(self) -> ToolCallStream:
        return MistralStream(self.tool_names)

    def tool_prompt(self, tools: Sequence[Mapping[str, Any]], *, parallel: bool) -> str:
        how_many = "For several calls, repeat the form." if parallel else "Call at most one function."
        return (
            "You can call the functions below (JSON schemas):\n"
            f"{tools_json(tools)}\n\n"
            f"To call a function, write {TOOL_CALLS}<function name>{ARGS}<arguments as a JSON object>. {how_many}"
        )

    def forced_grammar(self, tools: Sequence[Mapping[str, Any]]) -> str:
        """The newer form, one call: the marker, one tool's name, `[ARGS]`, an object matching its
        parameters. Markers that are special tokens are written by id."""
        specials = self.marker_tokens
        rules, options = [], []
        for k, tool in enumerate(tools):
            fn = tool.get("function", tool)
            schema = {**(fn.get("parameters") or ANY_OBJECT), "x-guidance": COMPACT_JSON}
            rules.append(f"args{k}: %json {json.dumps(schema)}\n")
            options.append(f"{json.dumps(str(fn.get('name')))} {lark_text(ARGS, specials)} args{k}")
        return f"start: {lark_text(TOOL_CALLS, specials)} call\ncall: {' | '.join(options)}\n" + "".join(rules)

    def format_calls(self, calls: Sequence[ToolCall]) -> str:
        return "".join(f"{TOOL_CALLS}{c.name}{ARGS}{c.arguments}" for c in calls)

    def template_call_id(self, call_id: str) -> str:
        """Mistral's templates refuse an id that is not 9 letters or digits: another id becomes 9
        hex digits of its hash, the same for a call and the result that names it."""
        if len(call_id) == 9 and call_id.isascii() and call_id.isalnum():
            return call_id
        return hashlib.sha256(call_id.encode()).hexdigest()[:9]
