"""Tool calling and reasoning for every chat-shaped route: request options, prompt rendering, sampling, parsing.

Owns `ToolOptions` (validated `tools` / `tool_choice` / `parallel_tool_calls`; `openai_tool_options`
checks OpenAI-style function tools, the form every protocol's tools are translated into), `ToolCalling` (one request's output handling: what goes to the chat
template — tools, and `enable_thinking` when the request says whether to think —, the sampling
changes — a forced-call grammar for `required` or a named function (markers that are tokens of
the model named by id: `marker_tokens`), special tokens kept for Harmony and for formats whose
markers are special tokens —, and the parsed result: reasoning split off by the `<think>` parser
where the model has one, then tool calls, with `parallel_tool_calls: false` applied), `tool_parser_name`
(`--tool-call-parser` or the model's own) and `reasoning_parser_name` (`--reasoning-parser` or the
model's own), and `with_tools`, the request recipe's one step into this module before generation:
the request's `ToolCalling` and its prompt rendered with it (`render_prompt`: `render_chat` with the
tools and template variables, or a protocol's own renderer). Message conversion for templates
that cannot render tools is in `tool_messages.py`; wire shapes are built by the protocol packages.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from freetoken.reasoning_budget import ReasoningBudget
from freetoken.request import SamplingParams
from freetoken.server.context import ServingContext
from freetoken.server.core.chat_prompt import Prompt, render_chat
from freetoken.server.core.grammar_check import check_tool_schemas
from freetoken.server.core.tool_messages import prepare_messages
from freetoken.server.errors import bad_request
from freetoken.tokenizer import ChatTemplateError, NoChatTemplate, Tokenizer
from freetoken.tokenizer.reasoning import MARKERS, ThinkStream, detect_reasoning_parser, reasoning_stream
from freetoken.tokenizer.tool_parsers import (
    ParsedOutput,
    StreamDelta,
    ToolCall,
    ToolCallDelta,
    ToolCallStream,
    ToolParser,
    detect_tool_parser,
    make_tool_parser,
    new_call_id,
)
from freetoken.tokenizer.tool_parsers.base import merge_deltas

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
    elif (
        isinstance(tool_choice, dict)
        and tool_choice.get("type") == "function"
        and isinstance(tool_choice.get("function"), dict)
    ):
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
        raise bad_request(
            f"{param}.function.name must be 1-64 letters, digits, '_', '-' or '.'", param=f"{param}.function.name"
        )
    if fn.get("description") is not None and not isinstance(fn.get("description"), str):
        raise bad_request(f"{param}.function.description must be a string", param=f"{param}.function.description")
    params = fn.get("parameters")
    if params is not None and not isinstance(params, dict):
        raise bad_request(
            f"{param}.function.parameters must be a JSON schema object", param=f"{param}.function.parameters"
        )
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
        chat_template=tokenizer.chat_template,
        special_tokens=special,
        architecture=None if info is None else info.architecture,
    )


def reasoning_parser_name(ctx: ServingContext, tool_parser: ToolParser) -> str | None:
    """`--reasoning-parser` (`none`: off), else `think` when the model's template or vocabulary
    knows `</think>`. Harmony models keep their reasoning channel in the tool parser."""
    if tool_parser.name == "harmony":
        return None
    chosen = ctx.config.reasoning_parser
    if chosen is not None:
        return None if chosen == "none" else chosen
    tokenizer = ctx.tokenizer
    special = [tokenizer.id_to_token(i) or "" for i in tokenizer.special_ids]
    return detect_reasoning_parser(chat_template=tokenizer.chat_template, tokens=special)


def marker_tokens(tokenizer: Tokenizer, markers: Sequence[str]) -> dict[str, int]:
    """The `markers` that are added tokens of `tokenizer` (Mistral's `[TOOL_CALLS]`, Qwen's
    `<tool_call>`), by id: a forced-call grammar names them by id, as llguidance takes every added
    token for a special one that no text literal matches."""
    added = tokenizer.backend.get_added_tokens_decoder()
    ids = {m: tokenizer.token_to_id(m) for m in markers}
    return {m: i for m, i in ids.items() if i is not None and i in added}


class ToolCalling:
    """One chat request's output handling. With no active tools it still parses when the format
    structures all output (Harmony's channels), accepting no calls. `thinking` is the request's
    say (True / False; None: the template's default), handed to templates as `enable_thinking`
    when the model has a reasoning parser."""

    def __init__(self, ctx: ServingContext, options: ToolOptions, thinking: bool | None = None) -> None:
        self.options = options
        names = [t["function"]["name"] for t in options.tools] if options.active else []
        schemas = {t["function"]["name"]: t["function"].get("parameters") or {} for t in options.tools}
        name = tool_parser_name(ctx)
        markers = make_tool_parser(name).markers
        self.parser: ToolParser = make_tool_parser(
            name, names, schemas=schemas, marker_tokens=marker_tokens(ctx.tokenizer, markers)
        )
        self.parses = options.active or self.parser.needs_special_tokens
        self.reasoning = reasoning_parser_name(ctx, self.parser)
        self.thinking = thinking
        self._ctx = ctx
        self._constrained = False  # a grammar shapes the output: no reasoning opened by the prompt
        self._opened = self.reasoning is not None and self._prompt_opens_reasoning()

    def template_context(self) -> dict[str, Any] | None:
        """Extra chat-template variables: `enable_thinking` where the model reasons and the request said."""
        if self.reasoning is None or self.thinking is None:
            return None
        return {"enable_thinking": self.thinking}

    def _prompt_opens_reasoning(self) -> bool:
        """Whether the template's generation prompt ends inside the reasoning's start marker (DeepSeek R1's does)."""
        try:
            text = self._ctx.tokenizer.apply_chat_template(
                [{"role": "user", "content": "x"}], add_generation_prompt=True, extra_context=self.template_context()
            )
        except (ChatTemplateError, NoChatTemplate):
            return False
        return self.reasoning is not None and text.rstrip().endswith(MARKERS[self.reasoning][0])

    def template_inputs(
        self, messages: list[dict[str, Any]]
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        """The messages and `tools` to hand the chat template (see `tool_messages.prepare_messages`)."""
        tools = list(self.options.tools) if self.options.active else []
        return prepare_messages(self._ctx.tokenizer, messages, tools, self.parser, parallel=self.options.parallel)

    def sampling(self, params: SamplingParams, *, reasoning_budget: int | None = None) -> SamplingParams:
        """The request's params with what its tools and reasoning need; `reasoning_budget`: at most
        that many tokens inside the reasoning (see `_budget`)."""
        special = self._ctx.tokenizer.special_ids
        calls_special = self.options.active and any(i in special for i in self.parser.marker_tokens.values())
        if self.parser.needs_special_tokens or calls_special or self._think_is_special():
            params = replace(params, skip_special_tokens=False)
        if self.options.forced:
            forced = self.options.forced_tools()
            check_tool_schemas(
                [
                    (f"tools[{k}].function.parameters", t["function"].get("parameters"))
                    for k, t in enumerate(self.options.tools)
                    if any(t is f for f in forced)
                ]
            )
            params = replace(params, grammar=("lark", self.parser.forced_grammar(forced)))
        self._constrained = params.grammar is not None
        if reasoning_budget is not None and self._splits_reasoning:
            params = replace(params, reasoning_budget=self._budget(reasoning_budget))
        return params

    def _budget(self, max_tokens: int) -> ReasoningBudget:
        """`max_tokens` model tokens between the reasoning parser's markers, then the engine writes
        the end marker (freetoken/reasoning_budget.py); the reasoning is open from the start where
        the generation prompt opened it. Only where the reasoning is split off: a grammar's output
        (forced calls, structured output) has none, and the engine must not write past a grammar."""
        start, end = MARKERS[self.reasoning or ""]
        tokenizer = self._ctx.tokenizer
        start_ids = () if self._opened else tuple(tokenizer.encode(start, add_special_tokens=False))
        return ReasoningBudget(max_tokens, start_ids, tuple(tokenizer.encode(end, add_special_tokens=False)))

    def _think_is_special(self) -> bool:
        """Whether the reasoning's start marker begins with a special token (decoding would drop it)."""
        if self.reasoning is None:
            return False
        start, tokenizer = MARKERS[self.reasoning][0], self._ctx.tokenizer
        return any(start.startswith(tokenizer.id_to_token(i) or "\0") for i in tokenizer.special_ids)

    @property
    def _splits_reasoning(self) -> bool:
        return self.reasoning is not None and not self._constrained

    def parse(self, text: str) -> ParsedOutput:
        """The whole output: the sum of what `stream` gives for it."""
        stream = self.stream()
        return merge_deltas([stream.feed(text), stream.finish()])

    def stream(self, *, incremental: bool = False) -> ToolStream:
        """A choice's incremental parse. `incremental`: a call's arguments come as fragments while
        they are written (`ToolCallDelta.first` opens the call); otherwise each call comes whole,
        once the next one starts or the output ends."""
        think = (
            reasoning_stream(self.reasoning, in_reasoning=self._opened)
            if self._splits_reasoning and self.reasoning
            else None
        )
        forced = self.options.forced and self._constrained
        tools = self.options.forced_tools() if forced else []
        return ToolStream(
            self.parser.stream() if self.parses else None,
            self.options.parallel,
            think,
            incremental=incremental,
            forced=forced,
            forced_name=tools[0]["function"]["name"] if len(tools) == 1 else None,
        )


Renderer = Callable[[Tokenizer, ToolCalling, list[dict[str, Any]]], Prompt]  # (tokenizer, tooling, messages) -> prompt


def render_prompt(tokenizer: Tokenizer, tooling: ToolCalling, messages: list[dict[str, Any]]) -> Prompt:
    """The conversation through `render_chat`, with the request's tools and template variables."""
    ids, boundaries = render_chat(tokenizer, *tooling.template_inputs(messages), tooling.template_context())
    return Prompt(ids, boundaries)


def with_tools(
    ctx: ServingContext,
    options: ToolOptions,
    messages: list[dict[str, Any]],
    *,
    thinking: bool | None = None,
    render: Renderer = render_prompt,
) -> tuple[ToolCalling, Prompt]:
    """A chat request's tool handling and its prompt rendered with it (template and tokenizer:
    callers run this off the event loop)."""
    tooling = ToolCalling(ctx, options, thinking)
    return tooling, render(ctx.tokenizer, tooling, messages)


class ToolStream:
    """One choice's incremental parse: reasoning split off first (when `think` is given), then tool
    calls (a `None` inner stream passes text through)."""

    def __init__(
        self,
        inner: ToolCallStream | None,
        parallel: bool,
        think: ThinkStream | None = None,
        *,
        incremental: bool = False,
        forced: bool = False,
        forced_name: str | None = None,
    ) -> None:
        self._inner = inner
        self._parallel = parallel
        self._think = think
        self._incremental = incremental
        # Under a forced-call grammar the output is a call, never text; cut off before the call's
        # name was written, it is a call of `forced_name` when only one tool could be called.
        self._forced = forced
        self._forced_name = forced_name
        self._pending: dict[int, ToolCall] = {}  # calls not yet handed out whole (not incremental)
        self.num_calls = 0

    def feed(self, text: str) -> StreamDelta:
        reasoning = ""
        if self._think is not None:
            reasoning, text = self._think.feed(text)
        return self._limit(reasoning, self._inner.feed(text) if self._inner is not None else StreamDelta(content=text))

    def finish(self) -> StreamDelta:
        delta = StreamDelta()
        if self._think is not None:
            reasoning, text = self._think.finish()
            delta = self._limit(
                reasoning, self._inner.feed(text) if self._inner is not None else StreamDelta(content=text)
            )
        delta.extend(self._limit("", self._inner.finish() if self._inner is not None else StreamDelta()))
        if self._forced_name is not None and not self.num_calls:  # cut off before the call's head was written
            delta.tool_calls.append(ToolCallDelta(0, ToolCall(new_call_id(), self._forced_name, "")))
            self.num_calls = 1
        delta.tool_calls += self._release(None)
        return delta

    def _limit(self, reasoning: str, delta: StreamDelta) -> StreamDelta:
        delta.reasoning = reasoning + delta.reasoning
        if self._forced:
            delta.content = ""
        calls = [d for d in delta.tool_calls if self._parallel or d.index == 0]
        self.num_calls += sum(d.first for d in calls)
        if self._incremental:
            delta.tool_calls = calls
            return delta
        whole: list[ToolCallDelta] = []
        for d in calls:
            if d.first:
                whole += self._release(d.index)
                self._pending[d.index] = d.call
            else:
                prev = self._pending[d.index]
                self._pending[d.index] = ToolCall(prev.id, prev.name, prev.arguments + d.call.arguments)
        delta.tool_calls = whole
        return delta

    def _release(self, below: int | None) -> list[ToolCallDelta]:
        """The pending calls with an index below `below` (None: all), whole."""
        done = sorted(i for i in self._pending if below is None or i < below)
        return [ToolCallDelta(i, self._pending.pop(i)) for i in done]
