"""gpt-oss Harmony output: channels, reasoning and function calls.

A generation is a run of messages, each `<|channel|>C [to=R] [<|constrain|>json]<|message|>BODY`
ended by `<|end|>`, `<|call|>` or `<|return|>`; later messages open with `<|start|>assistant`
(the recipient may also sit there). `analysis` bodies are reasoning, `final` bodies (and
`commentary` without a recipient) are content, and a `commentary` message `to=functions.NAME`
is a call whose body is the JSON arguments. A call of a known tool is announced once its header
is read and its arguments stream out as the body is written; it ends with its body (`<|call|>`
is a stop token a server may cut, so the end of the output ends it too), whatever the body turns
out to be. Output without Harmony markers, a header that never ends and unknown tools are
returned as text. The markers are special tokens, so this format needs
`skip_special_tokens=False`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from freetoken.tokenizer.detokenizer import held_back
from freetoken.tokenizer.tool_parsers.base import (
    StreamDelta,
    ToolCall,
    ToolCallDelta,
    ToolCallStream,
    ToolParser,
    new_call_id,
    tools_json,
)
from freetoken.tokenizer.tool_parsers.grammar import COMPACT_JSON, lark_text

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
OPENERS = (START, CHANNEL)  # a new message starting without an end marker ends the body too
_CHANNEL_RE = re.compile(r"<\|channel\|>\s*([A-Za-z_]+)")
_RECIPIENT_RE = re.compile(r"to=([^\s<]+)")
FUNCTIONS = "functions."


class _HarmonyStream(ToolCallStream):
    def __init__(self, tool_names: frozenset[str] | None) -> None:
        self._names = tool_names
        self._buffer = ""
        self._raw = False  # no Harmony structure: everything is content
        self._header: str | None = None  # set while in a body: the raw header text
        self._channel = ""
        self._recipient: str | None = None
        self._num_calls = 0
        self._streamed: str | None = None  # the arguments sent so far of the call being written

    def _flush(self, out: StreamDelta) -> None:
        if self._header is not None:
            self._end_body(self._buffer, "", out)
        elif self._buffer.strip():
            out.content += self._buffer
        self._buffer = ""

    def _step(self, out: StreamDelta, *, final: bool) -> bool:
        if self._raw:
            out.content += self._buffer
            self._buffer = ""
            return False
        if self._header is None:
            return self._read_header(final=final)
        return self._read_body(out, final=final)

    def _read_header(self, *, final: bool) -> bool:
        head = self._buffer.lstrip()
        if not head:
            return False
        if not head.startswith(OPENERS):
            if any(o.startswith(head) for o in OPENERS) and not final:
                return False  # may still become a marker
            self._raw = True
            return True
        i = head.find(MESSAGE)
        if i < 0:
            return False
        header = head[:i]
        channel = _CHANNEL_RE.search(header)
        recipient = _RECIPIENT_RE.search(header)
        self._header = header + MESSAGE
        self._channel = channel.group(1) if channel else ""
        self._recipient = recipient.group(1) if recipient else None
        self._buffer = head[i + len(MESSAGE) :]
        return True

    def _read_body(self, out: StreamDelta, *, final: bool) -> bool:
        hits = [(self._buffer.find(m), m) for m in (*ENDS, *OPENERS)]
        hits = [(i, m) for i, m in hits if i >= 0]
        if hits:
            i, marker = min(hits)
            consumed = marker if marker in ENDS else ""
            self._end_body(self._buffer[:i], consumed, out)
            self._buffer = self._buffer[i + len(consumed) :]
            return True
        if self._recipient is None or self._call_name() is not None:  # text and arguments stream out as they come
            keep = 0 if final else held_back(self._buffer, (*ENDS, *OPENERS))
            ready = self._buffer[: len(self._buffer) - keep]
            if self._recipient is not None:  # arguments end without trailing whitespace: hold it back
                ready = ready.rstrip()
            self._write(ready, out)
            self._buffer = self._buffer[len(ready) :]
        return False

    def _call_name(self) -> str | None:
        """The known tool the current message calls, or None."""
        recipient = self._recipient
        if recipient is None or not recipient.startswith(FUNCTIONS):
            return None
        name = recipient[len(FUNCTIONS) :]
        return name if name and (self._names is None or name in self._names) else None

    def _write(self, text: str, out: StreamDelta) -> None:
        name = self._call_name()
        if name is None:
            self._text(text, out)
            return
        if self._streamed is None:
            out.tool_calls.append(ToolCallDelta(self._num_calls, ToolCall(new_call_id(), name, "")))
            self._streamed = ""
        if not self._streamed:
            text = text.lstrip()
        if text:
            out.tool_calls.append(ToolCallDelta(self._num_calls, ToolCall("", "", text), first=False))
            self._streamed += text

    def _text(self, text: str, out: StreamDelta) -> None:
        if self._channel == "analysis":
            out.reasoning += text
        else:
            out.content += text

    def _end_body(self, body: str, end: str, out: StreamDelta) -> None:
        header = self._header or ""
        if self._recipient is None:
            self._text(body, out)
        elif self._call_name() is not None:
            self._write(body.rstrip(), out)
            if not (self._streamed or "").strip():  # an empty body: no arguments
                out.tool_calls.append(ToolCallDelta(self._num_calls, ToolCall("", "", "{}"), first=False))
            self._num_calls += 1
            self._streamed = None
        else:
            out.content += header + body + end
        self._header, self._recipient = None, None


class HarmonyParser(ToolParser):
    name = "harmony"
    needs_special_tokens = True

    def stream(self) -> ToolCallStream:
        return _HarmonyStream(self.tool_names)

    def tool_prompt(self, tools: Sequence[Mapping[str, Any]], *, parallel: bool) -> str:
        return (
            "# Tools\n\n## functions\n\nThe functions below are described as JSON schemas:\n"
            f"{tools_json(tools)}\n\n"
            "Call a function in the commentary channel addressed to=functions.NAME, with its arguments as a JSON "
            "object in the message body."
        )

    def forced_grammar(self, tools: Sequence[Mapping[str, Any]]) -> str:
        # The recipient names the function, so each tool is its own alternative.
        heads, rules = [], []
        for k, tool in enumerate(tools):
            fn = tool.get("function", tool)
            heads.append(
                lark_text(f"{CHANNEL}commentary to=functions.{fn.get('name')} <|constrain|>json{MESSAGE}") + f" args{k}"
            )
            schema = {**(fn.get("parameters") or {"type": "object"}), "x-guidance": COMPACT_JSON}
            rules.append(f"args{k}: %json {json.dumps(schema)}\n")
        start, rules = " | ".join(heads), "".join(rules)
        return f"start: {start}\n{rules}"

    def format_calls(self, calls: Sequence[ToolCall]) -> str:
        return "".join(
            f"{START}assistant{CHANNEL}commentary to=functions.{c.name} <|constrain|>json{MESSAGE}{c.arguments}<|call|>"
            for c in calls
        )

    def format_result(self, content: str, name: str | None) -> str:
        return json.dumps({"tool": name, "result": content}, ensure_ascii=False)
