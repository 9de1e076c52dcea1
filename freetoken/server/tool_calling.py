"""Tool calling for the chat routes: request options, prompt rendering, sampling and parsing.

Owns `ToolOptions` (validated `tools` / `tool_choice` / `parallel_tool_calls`, from the OpenAI or
the Anthropic request), `ToolCalling` (one request's parser: what goes to the chat template, the
sampling changes — a forced-call grammar for `required` or a named function, special tokens kept
for Harmony —, and the parsed result with `parallel_tool_calls: false` applied) and
`tool_parser_name` (`--tool-call-parser` or the model's own). Message conversion for templates
that cannot render tools is in `tool_messages.py`; wire shapes are built by the route modules.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from freetoken.request import SamplingParams
from freetoken.server.context import ServingContext
from freetoken.server.errors import bad_request
from freetoken.server.tool_messages import prepare_messages
from freetoken.tokenizer.tool_parsers import ParsedOutput, StreamDelta, ToolCallStream, ToolParser, detect_tool_parser, make_tool_parser

_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
CHOICES = ("auto", "none", "required")


@dataclass(frozen=True)
class ToolOptions:
    """`tools` as OpenAI function tools, `choice` one of CHOICES, `named` the forced function."""

    tools: tuple[dict[str, Any], ...] = ()
    choice: str = "none"
    named: str | None = None
    parallel: bool = True

    @property
    def active(self) -> bool:
        return bool(self.tools) and self.choice != "none"

    @property
    def forced(self) -> bool:
        return self.active and (self.choice == "required" or self.named is not None)

    def forced_tools(self) -> list[dict[str, Any]]:
        return [t for t in self.tools if self.named is None or t["function"]["name"] == self.named]


def openai_tool_options(tools: Sequence[Any] | None, tool_choice: Any, parallel: bool | None) -> ToolOptions:
    """Validate the OpenAI fields (a 400 naming the field when one is wrong)."""
    checked = tuple(_check_tool(t, k) for k, t in enumerate(tools or ()))
    names = [t["function"]["name"] for t in checked]
    if len(set(names)) != len(names):
        raise bad_request("tools: function names must be unique", param="tools")
    named = None
    if tool_choice is None:
        choice = "auto" if checked else "none"
    elif isinstance(tool_choice, str) and tool_choice in CHOICES:
        choice = tool_choice
    elif isinstance(tool_choice, dict) and tool_choice.get("type") == "function" and isinstance(tool_choice.get("function"), dict):
        choice, named = "required", tool_choice["function"].get("name")
        if named not in names:
            raise bad_request(f"tool_choice names function {named!r}, which is not in tools", param="tool_choice")
    else:
        raise bad_request(
            'tool_choice must be "auto", "none", "required" or {"type": "function", "function": {"name": ...}}',
            param="tool_choice",
        )
    if choice == "required" and not checked:
        raise bad_request("tool_choice requires a tool call but tools is empty", param="tool_choice")
    return ToolOptions(checked, choice, named, True if parallel is None else parallel)


def _check_tool(tool: Any, k: int) -> dict[str, Any]:
    param = f"tools[{k}]"
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise bad_request(f'{param} must be {{"type": "function", "function": {{...}}}}', param=param)
    fn = tool["function"]
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise bad_request(f"{param}.function.name must be 1-64 letters, digits, '_', '-' or '.'", param=f"{param}.function.name")
    if fn.get("description") is not None and not isinstance(fn.get("description"), str):
        raise bad_request(f"{param}.function.description must be a string", param=f"{param}.function.description")
    params = fn.get("parameters")
    if params is not None and not isinstance(params, dict):
        raise bad_request(f"{param}.function.parameters must be a JSON schema object", param=f"{param}.function.parameters")
    out: dict[str, Any] = {"name": name}
    if fn.get("description"):
        out["description"] = fn["description"]
    out["parameters"] = params if params is not None else {"type": "object", "properties": {}}
    return {"type": "function", "function": out}


def tool_parser_name(ctx: ServingContext) -> str:
    """`--tool-call-parser`, else the format the model's template, vocabulary and architecture say."""
    if ctx.config.tool_call_parser is not None:
        return ctx.config.tool_call_parser
    tokenizer = ctx.tokenizer
    special = [tokenizer.id_to_token(i) or "" for i in tokenizer.special_ids]
    info = ctx.client.info
    return detect_tool_parser(
        chat_template=tokenizer.chat_template, special_tokens=special, architecture=None if info is None else info.architecture
    )


class ToolCalling:
    """One chat request's tool handling. With no active tools it still parses when the format
    structures all output (Harmony's channels), accepting no calls."""

    def __init__(self, ctx: ServingContext, options: ToolOptions) -> None:
        self.options = options
        names = [t["function"]["name"] for t in options.tools] if options.active else []
        self.parser: ToolParser = make_tool_parser(tool_parser_name(ctx), names)
        self.parses = options.active or self.parser.needs_special_tokens
        self._ctx = ctx

    def template_inputs(self, messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        """The messages and `tools` to hand the chat template (see `tool_messages.prepare_messages`)."""
        tools = list(self.options.tools) if self.options.active else []
        return prepare_messages(self._ctx.tokenizer, messages, tools, self.parser, parallel=self.options.parallel)

    def sampling(self, params: SamplingParams) -> SamplingParams:
        if self.parser.needs_special_tokens:
            params = replace(params, skip_special_tokens=False)
        if self.options.forced:
            params = replace(params, grammar=("lark", self.parser.forced_grammar(self.options.forced_tools())))
        return params

    def parse(self, text: str) -> ParsedOutput:
        out = self.parser.parse(text) if self.parses else ParsedOutput(text, "", ())
        if not self.options.parallel and len(out.tool_calls) > 1:
            out = ParsedOutput(out.content, out.reasoning, out.tool_calls[:1])
        return out

    def stream(self) -> ToolStream:
        return ToolStream(self.parser.stream() if self.parses else None, self.options.parallel)


class ToolStream:
    """One choice's incremental parse; `None` inner stream passes text through."""

    def __init__(self, inner: ToolCallStream | None, parallel: bool) -> None:
        self._inner = inner
        self._parallel = parallel
        self.num_calls = 0

    def feed(self, text: str) -> StreamDelta:
        return self._limit(self._inner.feed(text) if self._inner is not None else StreamDelta(content=text))

    def finish(self) -> StreamDelta:
        return self._limit(self._inner.finish() if self._inner is not None else StreamDelta())

    def _limit(self, delta: StreamDelta) -> StreamDelta:
        if not self._parallel:
            delta.tool_calls = [d for d in delta.tool_calls if d.index == 0]
        self.num_calls += len(delta.tool_calls)
        return delta


def finish_reason(reason: str | None, num_calls: int) -> str | None:
    """`tool_calls` replaces a normal end when the output held calls."""
    return "tool_calls" if num_calls and reason in ("stop", "length") else reason


def openai_tool_calls(out: ParsedOutput | StreamDelta) -> list[dict[str, Any]]:
    """OpenAI's `tool_calls` items (with `index` for stream deltas)."""
    if isinstance(out, StreamDelta):
        return [
            {"index": d.index, "id": d.call.id, "type": "function", "function": {"name": d.call.name, "arguments": d.call.arguments}}
            for d in out.tool_calls
        ]
    return [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in out.tool_calls]


def openai_message(out: ParsedOutput) -> dict[str, Any]:
    """The assistant `message` of a non-streamed choice."""
    message: dict[str, Any] = {"role": "assistant", "content": out.content if out.content or not out.tool_calls else None}
    if out.reasoning:
        message["reasoning_content"] = out.reasoning
    if out.tool_calls:
        message["tool_calls"] = openai_tool_calls(out)
    return message


def openai_delta(delta: StreamDelta) -> dict[str, Any]:
    """A stream chunk's `delta` (empty when nothing is certain yet)."""
    out: dict[str, Any] = {}
    if delta.reasoning:
        out["reasoning_content"] = delta.reasoning
    if delta.content:
        out["content"] = delta.content
    if delta.tool_calls:
        out["tool_calls"] = openai_tool_calls(delta)
    return out

