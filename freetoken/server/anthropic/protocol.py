"""Anthropic Messages request schemas (pydantic) and their conversion to the chat-template messages.

Owns what `POST /v1/messages` and `/v1/messages/count_tokens` may contain (strict types, unknown
fields refused with a 400 naming them; the fields Claude Code and the SDK send that have no effect
here — `context_management`, `output_config.effort`, `service_tier`, `cache_control`,
`citations` — typed, then ignored; `thread` is the thread store's), the conversion of Anthropic
content blocks into the OpenAI-style message list the chat templates render (`tool_use` -> an
assistant message's `tool_calls`, `tool_result` -> a `tool` role message, a replayed `thinking`
block -> the assistant's `reasoning_content`, which templates render or drop, a `system` role
message -> a system message in place; a system block of Claude Code's billing line
`x-anthropic-billing-header: ...` is left out), `thinking` (enabled / adaptive: think, where the model
can), structured output (`output_config.format`, `output_format`) and the Anthropic ->
SamplingParams checks. `tools` / `tool_choice` are validated into `ToolOptions` by `tool_blocks.py`; what they do
to the prompt, the sampling and the reply is tool calling's. It does no tokenization and knows
nothing of the engine.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from freetoken.request import SamplingParams
from freetoken.server.anthropic.tool_blocks import anthropic_tool_options
from freetoken.server.core.grammar_check import check_grammar
from freetoken.server.core.tool_calling import ToolOptions
from freetoken.server.errors import bad_request

MAX_STOP_SEQUENCES = 16
MAX_TEMPERATURE = 1.0  # Anthropic's range is [0, 1]
BILLING_HEADER = (
    "x-anthropic-billing-header:"  # Claude Code's first system block: for Anthropic's billing, not the model
)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class CacheControl(_Strict):
    """Accepted and unused: the prefix cache is automatic."""

    type: Literal["ephemeral"]
    ttl: str | None = None


class TextBlock(_Strict):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: list[dict[str, Any]] | None = None  # on replayed assistant text: accepted, not rendered


class ToolUseBlock(_Strict):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolResultBlock(_Strict):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None
    cache_control: CacheControl | None = None

    def text(self) -> str:
        if self.content is None:
            body = ""
        elif isinstance(self.content, str):
            body = self.content
        else:
            body = "\n".join(block.text for block in self.content)
        return f"Error: {body}" if self.is_error else body


class ThinkingBlock(_Strict):
    """Reasoning of an earlier assistant turn, replayed: handed to the template as `reasoning_content`."""

    type: Literal["thinking"]
    thinking: str
    signature: str | None = None
    cache_control: CacheControl | None = None


class RedactedThinkingBlock(_Strict):
    """Encrypted reasoning of another server: nothing to render, dropped."""

    type: Literal["redacted_thinking"]
    data: str


class UnsupportedBlock(BaseModel):
    """A block type Anthropic defines that this server does not take; refused by name."""

    model_config = ConfigDict(extra="allow")
    type: Literal["image", "document", "search_result", "server_tool_use", "web_search_tool_result"]


Block = Annotated[
    TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock | UnsupportedBlock,
    Field(discriminator="type"),
]


class AnthropicMessage(_Strict):
    role: Literal["user", "assistant", "system"]  # system: Claude Code's mid-conversation system messages
    content: str | list[Block]


class Metadata(_Strict):
    user_id: str | None = None  # an opaque end-user id, as Anthropic documents it; unused


class ThinkingDisabled(_Strict):
    type: Literal["disabled"]


MIN_THINKING_BUDGET = 1024  # Anthropic's smallest budget_tokens


class ThinkingEnabled(_Strict):
    """Think first, where the model can, for at most `budget_tokens` tokens: past them the engine
    ends the reasoning itself (the reasoning parser's end marker) and the answer follows. The
    reasoning counts against max_tokens."""

    type: Literal["enabled"]
    budget_tokens: int
    display: Literal["summarized", "omitted"] | None = None


class ThinkingAdaptive(_Strict):
    type: Literal["adaptive"]
    display: Literal["summarized", "omitted"] | None = None


Thinking = Annotated[ThinkingDisabled | ThinkingEnabled | ThinkingAdaptive, Field(discriminator="type")]


class JsonOutputFormat(_Strict):
    """Structured output: the reply's text is JSON valid against `schema` (through the grammar)."""

    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Strict):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None  # accepted and ignored
    format: JsonOutputFormat | None = None


class ContextManagement(_Strict):
    """Server-side context edits (clearing old tool results or thinking): accepted and ignored;
    the client's conversation is rendered as sent."""

    edits: list[dict[str, Any]] | None = None


class Thread(_Strict):
    """Server-held conversation state, as the SDK's tool runner asks for it: `create` keeps this
    conversation under the reply's id, `continue` sends only the new turn after the one kept
    under `previous_message_id` (threads.py). The response shape is unchanged."""

    type: Literal["create", "continue"]
    previous_message_id: str | None = None


class Conversation(_Strict):
    """Fields shared by /v1/messages and /v1/messages/count_tokens."""

    model: str
    messages: list[AnthropicMessage]
    system: str | list[TextBlock] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: Thinking | None = None
    cache_control: CacheControl | None = None  # automatic caching: accepted, the prefix cache always is
    context_management: ContextManagement | None = None
    output_config: OutputConfig | None = None
    output_format: JsonOutputFormat | None = None  # the older beta spelling of output_config.format

    def wants_thinking(self) -> bool | None:
        """True for enabled / adaptive, False for disabled, None when not said (Anthropic's
        default: no thinking)."""
        if self.thinking is None:
            return None
        if isinstance(self.thinking, ThinkingEnabled) and self.thinking.budget_tokens < MIN_THINKING_BUDGET:
            raise bad_request(
                f"thinking.budget_tokens must be at least {MIN_THINKING_BUDGET}, got {self.thinking.budget_tokens}",
                param="thinking.budget_tokens",
            )
        return not isinstance(self.thinking, ThinkingDisabled)

    def thinking_budget(self) -> int | None:
        """`budget_tokens` of an enabled `thinking` (adaptive and disabled have none)."""
        return self.thinking.budget_tokens if isinstance(self.thinking, ThinkingEnabled) else None

    def omits_thinking(self) -> bool:
        """`display: "omitted"`: thinking blocks go out empty (the reasoning still happens)."""
        return self.thinking is not None and getattr(self.thinking, "display", None) == "omitted"

    def output_grammar(self) -> tuple[str, str] | None:
        """The grammar of `output_config.format` / `output_format` (one of them, or both the same)."""
        formats = [
            f for f in (self.output_config.format if self.output_config else None, self.output_format) if f is not None
        ]
        if len(formats) == 2 and formats[0].schema_ != formats[1].schema_:
            raise bad_request("output_format and output_config.format disagree; send one", param="output_format")
        if not formats:
            return None
        grammar = ("json_schema", json.dumps(formats[0].schema_))
        check_grammar(
            grammar, "output_config.format" if self.output_config and self.output_config.format else "output_format"
        )
        return grammar

    def chat_messages(self) -> list[dict[str, Any]]:
        """The conversation as chat-template messages (system first)."""
        if not self.messages:
            raise bad_request("messages must not be empty", param="messages")
        out: list[dict[str, Any]] = []
        if isinstance(self.system, str) or self.system is None:
            system = self.system
        else:  # Claude Code's billing line changes with every prompt: kept, no session would share a cached prefix
            system = "\n".join(b.text for b in self.system if not b.text.startswith(BILLING_HEADER))
        if system:
            out.append({"role": "system", "content": system})
        for i, message in enumerate(self.messages):
            out += convert_message(message, f"messages[{i}]")
        return out

    def tool_options(self) -> ToolOptions:
        """`tools` and `tool_choice` (with `disable_parallel_tool_use`), validated: a 400 naming the
        field when one is wrong."""
        return anthropic_tool_options(self.tools, self.tool_choice)


class CountTokensRequest(Conversation):
    pass


class MessagesRequest(Conversation):
    max_tokens: int
    stop_sequences: list[str] | None = None
    stream: bool | None = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None  # accepted and ignored
    thread: Thread | None = None

    def continued_from(self) -> str | None:
        """The message id a `continue` thread resumes after (a 400 naming the key when it is missing)."""
        if self.thread is None or self.thread.type != "continue":
            return None
        if not self.thread.previous_message_id:
            raise bad_request(
                "thread.previous_message_id is required to continue a thread", param="thread.previous_message_id"
            )
        return self.thread.previous_message_id

    def stop_strings(self) -> tuple[str, ...]:
        stops = list(self.stop_sequences or ())
        if len(stops) > MAX_STOP_SEQUENCES:
            raise bad_request(f"at most {MAX_STOP_SEQUENCES} stop sequences, got {len(stops)}", param="stop_sequences")
        return tuple(s for s in stops if s)

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        """Range-checked SamplingParams (a 400 naming the field when one is out of range:
        `temperature` in Anthropic's [0, 1] first, then the engine's ranges)."""
        if self.temperature is not None and not 0.0 <= self.temperature <= MAX_TEMPERATURE:
            raise bad_request(
                f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature}", param="temperature"
            )
        if self.max_tokens < 1:
            raise bad_request(f"max_tokens must be at least 1, got {self.max_tokens}", param="max_tokens")
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            stop=self.stop_strings(),
            skip_special_tokens=True,
            grammar=self.output_grammar(),
        )
        try:
            params.validate()
        except ValueError as err:
            raise bad_request(str(err), param=str(err).split(" ", 1)[0]) from None
        return params


def convert_message(message: AnthropicMessage, where: str) -> list[dict[str, Any]]:
    """One Anthropic message as chat-template messages, in block order: runs of text blocks become
    one message of the role; a user's `tool_result` becomes a `tool` message; an assistant's
    `tool_use` blocks become its `tool_calls` (OpenAI style, arguments as a JSON string) and its
    `thinking` blocks its `reasoning_content`; `redacted_thinking` is dropped. A `system` message
    holds text only."""
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    out: list[dict[str, Any]] = []
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    thoughts: list[str] = []

    def flush_text() -> None:
        if texts:
            out.append({"role": message.role, "content": "\n".join(texts)})
            texts.clear()

    for j, block in enumerate(message.content):
        param = f"{where}.content[{j}]"
        if isinstance(block, UnsupportedBlock):
            raise bad_request(f"content blocks of type '{block.type}' are not supported by this server", param=param)
        if message.role == "system" and not isinstance(block, TextBlock):
            raise bad_request("system messages hold text blocks only", param=param)
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, (ThinkingBlock, RedactedThinkingBlock)):
            if message.role != "assistant":
                raise bad_request(f"{block.type} blocks belong in assistant messages", param=param)
            if isinstance(block, ThinkingBlock) and block.thinking:
                thoughts.append(block.thinking)
        elif isinstance(block, ToolUseBlock):
            if message.role != "assistant":
                raise bad_request("tool_use blocks belong in assistant messages", param=param)
            calls.append(
                {
                    "id": block.id,
                    "type": "function",
                    "function": {"name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False)},
                }
            )
        else:
            if message.role != "user":
                raise bad_request("tool_result blocks belong in user messages", param=param)
            flush_text()
            out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": block.text()})
    if message.role == "assistant":
        if texts or calls or thoughts or not out:
            entry: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts)}
            if calls:
                entry["tool_calls"] = calls
            if thoughts:
                entry["reasoning_content"] = "\n".join(thoughts)
            out.append(entry)
    else:
        flush_text()
    return out
