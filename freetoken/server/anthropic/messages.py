"""`POST /v1/messages` and `/v1/messages/count_tokens`: Anthropic Messages over the chat path.

Owns the Anthropic response bodies (`message` objects, `usage` with `cache_read_input_tokens` =
the prefix-cache hit, `stop_reason` from the engine's finish and the matched stop string, or
`tool_use`; `thinking` blocks first when the request asked to think and the model reasoned) and
the event stream in Anthropic's order: `message_start`, then per content block
`content_block_start`, `content_block_delta`..., `content_block_stop` (one `ping` right after the
first start), `message_delta`, `message_stop`; a failure after the stream started is one
`event: error` and the stream ends. Also `message_input`, the request as the core recipe's
`ChatInput`, and the `thread` continuation (threads.py). Conversations, tools included, are
rendered through the same recipe as `/v1/chat/completions`, so `count_tokens` counts exactly the
prompt `/v1/messages` would run. Tool calling (prompt, forced-call grammar, parsing) is
`core.tool_calling`'s and its Anthropic shapes `tool_blocks.py`'s; here they are placed in the body
and the stream. Request-level errors are raised as `APIError`; the router answers them in
Anthropic's shape. It never imports torch.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from typing import Any

import anyio.to_thread
from fastapi.responses import JSONResponse, Response

from freetoken.server.anthropic.errors import error_event, event
from freetoken.server.anthropic.pins import anthropic_pin_marks
from freetoken.server.anthropic.protocol import AnthropicMessage, Conversation, CountTokensRequest, MessagesRequest
from freetoken.server.anthropic.threads import KeptThread, ThreadStore
from freetoken.server.anthropic.tool_blocks import AnthropicBlockStream, anthropic_content, tool_stop_reason
from freetoken.server.context import ServingContext
from freetoken.server.core.chat_prompt import Prompt
from freetoken.server.core.generation import ChoiceResult, Clock, Piece
from freetoken.server.core.recipe import ChatInput, PreparedChat, prepare_chat
from freetoken.server.core.run import start
from freetoken.server.core.streaming import Tally, sse_response
from freetoken.server.core.tool_calling import ToolCalling, ToolOptions, with_tools
from freetoken.server.errors import APIError, bad_request
from freetoken.server.operations.request_log import log_plain
from freetoken.server.sampling_defaults import left_out
from freetoken.tokenizer.tool_parsers import StreamDelta
from freetoken.tokenizer.tool_parsers.base import merge_deltas

ENDPOINT = "messages"


def conversation(req: Conversation) -> tuple[list[dict[str, Any]], ToolOptions, bool]:
    """The conversation's chat-template messages, its tools and whether to think (400s naming the
    field). Not asked is no: Anthropic's default, so templates that think by default are told not to."""
    return req.chat_messages(), req.tool_options(), bool(req.wants_thinking())


def message_input(req: MessagesRequest) -> ChatInput:
    """The request in the core's terms; a 400 naming the field for a value it cannot take."""
    params = req.sampling_params(req.max_tokens)  # range checks before anything else
    messages, tools, thinking = conversation(req)
    return ChatInput(
        messages=messages,
        params=params,
        max_tokens=req.max_tokens,
        tools=tools,
        thinking=thinking,
        reasoning_budget=req.thinking_budget(),
        pins=anthropic_pin_marks(req),
        unset=left_out(req),
    )


def stop_reason(finish_reason: str | None, stop_string: str | None) -> tuple[str, str | None]:
    """Anthropic's `stop_reason` and `stop_sequence` for an engine finish."""
    if finish_reason == "length":
        return "max_tokens", None
    if finish_reason == "stop" and stop_string is not None:
        return "stop_sequence", stop_string
    return "end_turn", None


def usage(prompt_tokens: int, cached_tokens: int, output_tokens: int, created_tokens: int = 0) -> dict[str, int]:
    """Anthropic's usage: `cache_read_input_tokens` is the prefix-cache hit,
    `cache_creation_input_tokens` the prompt tokens past it that the request's `cache_control`
    pins keep (kv/pins.py), `input_tokens` the rest: the three add up to the whole prompt."""
    return {
        "input_tokens": prompt_tokens - cached_tokens - created_tokens,
        "output_tokens": output_tokens,
        "cache_read_input_tokens": cached_tokens,
        "cache_creation_input_tokens": created_tokens,
    }


async def count_message_tokens(ctx: ServingContext, req: CountTokensRequest, request_id: str) -> Response:
    def render() -> Prompt:
        messages, tools, thinking = conversation(req)
        return with_tools(ctx, tools, messages, thinking=thinking)[1]

    prompt = await anyio.to_thread.run_sync(render)  # template + tokenizer: off the event loop
    log_plain("count_tokens", 200, request_id, prompt_tokens=len(prompt.ids))  # its line: nothing generates
    return JSONResponse({"input_tokens": len(prompt.ids)})


def continued(req: MessagesRequest, threads: ThreadStore | None) -> MessagesRequest:
    """A `continue` thread request with the conversation kept under its previous message id
    before its own turn (a 400 when this server keeps no threads)."""
    previous = req.continued_from()
    if previous is None:
        return req
    if threads is None:
        raise bad_request("this server keeps no threads; send the whole conversation", param="thread")
    kept = threads.get(previous)
    return req.model_copy(
        update={
            "messages": [*kept.messages, *req.messages],
            "system": kept.system if req.system is None else req.system,
            "tools": kept.tools if req.tools is None else req.tools,
        }
    )


async def create_message(
    ctx: ServingContext, req: MessagesRequest, request_id: str, threads: ThreadStore | None = None
) -> Response:
    """One message. With `threads`, a `thread` request keeps its conversation there and a
    `continue` one is rendered after the conversation kept under its previous message id."""
    clock = Clock()
    req = continued(req, threads)
    prepared = await prepare_chat(
        ctx, await anyio.to_thread.run_sync(message_input, req)
    )  # block conversion: off the event loop
    message_id = f"msg_{uuid.uuid4().hex}"
    run = start(ctx, ENDPOINT, prepared, request_id, message_id, clock)
    head = {"id": message_id, "type": "message", "role": "assistant", "model": ctx.served_name}

    def keep(content: list[dict[str, Any]]) -> None:
        if threads is not None and req.thread is not None:
            reply = AnthropicMessage.model_validate({"role": "assistant", "content": content})
            threads.put(message_id, KeptThread((*req.messages, reply), req.system, req.tools))

    if not req.stream:
        result = (await run.collect())[0]
        return JSONResponse(message_body(head, result, prepared, req.omits_thinking(), keep))
    first = await run.first()
    framing = MessageFraming(
        tooling=prepared.tooling,
        head=head,
        prompt_tokens=len(prepared.prompt.ids),
        request_id=request_id,
        on_done=keep,
        omit_thinking=req.omits_thinking(),
    )
    return sse_response(run.events(first, framing))


def message_body(
    head: dict[str, Any],
    result: ChoiceResult,
    prepared: PreparedChat,
    omit_thinking: bool,
    keep: Callable[[list[dict[str, Any]]], None],
) -> dict[str, Any]:
    """The `message` object of a whole reply (its content kept for the thread first)."""
    parsed = prepared.tooling.parse(result.text)
    reason, sequence = stop_reason(result.finish_reason, result.stop_string)
    content = anthropic_content(parsed, thinking=prepared.tooling.thinking, omit_thinking=omit_thinking)
    keep(content)
    return {
        **head,
        "content": content,
        "stop_reason": tool_stop_reason(reason, len(parsed.tool_calls)),
        "stop_sequence": sequence,
        "usage": usage(
            len(prepared.prompt.ids),
            result.report.cached_tokens,
            len(result.token_ids),
            result.report.cache_creation_tokens,
        ),
    }


class _Framer:
    """Content-block events as SSE text, with the one `ping` right after the first block's start
    (where Anthropic sends it)."""

    def __init__(self) -> None:
        self._pinged = False

    def __call__(self, events: list[tuple[str, dict[str, Any]]]) -> list[str]:
        out = []
        for name, data in events:
            out.append(event(name, data))
            if not self._pinged:
                self._pinged = True
                out.append(event("ping", {"type": "ping"}))
        return out


class MessageFraming:
    """Anthropic's events for one streamed message (core/streaming.py's `Framing`): `message_start`
    with the usage known at the first piece, the content blocks as the parser splits the text,
    `message_delta` with the stop reason and the final usage, `message_stop`; a failure is one
    `event: error`. `on_done` gets the message's content blocks once it ended well."""

    def __init__(
        self,
        *,
        tooling: ToolCalling,
        head: dict[str, Any],
        prompt_tokens: int,
        request_id: str,
        on_done: Callable[[list[dict[str, Any]]], None],
        omit_thinking: bool = False,
    ) -> None:
        self._tooling = tooling
        self._head = head
        self._prompt_tokens = prompt_tokens
        self._request_id = request_id
        self._on_done = on_done
        self._omit_thinking = omit_thinking
        self._created = 0  # prompt tokens the request's pins keep: known at the first piece
        self._parser = tooling.stream(incremental=True)
        self._blocks = AnthropicBlockStream(thinking=bool(tooling.thinking), omit_thinking=omit_thinking)
        self._frame = _Framer()
        self._written: list[StreamDelta] = []
        self._finish: str | None = None
        self._stop_string: str | None = None

    def opening(self, first: Piece | None) -> list[str]:
        cached = 0 if first is None else first.report.cached_tokens
        self._created = (
            0 if first is None else first.report.cache_creation_tokens
        )  # pins are applied before the first token
        start_usage = usage(self._prompt_tokens, cached, 0, self._created)
        start = {**self._head, "content": [], "stop_reason": None, "stop_sequence": None, "usage": start_usage}
        return [event("message_start", {"type": "message_start", "message": start})]

    def piece(self, piece: Piece) -> list[str]:
        delta = self._parser.feed(piece.text)
        self._written.append(delta)
        out = self._frame(self._blocks.events(delta))
        if piece.finish_reason is not None:
            self._finish, self._stop_string = piece.finish_reason, piece.stop_string
        return out

    def closing(self, tally: Tally) -> Iterator[str]:
        last = self._parser.finish()
        self._written.append(last)
        yield from self._frame(self._blocks.events(last) + self._blocks.close())
        self._on_done(
            anthropic_content(
                merge_deltas(self._written), thinking=self._tooling.thinking, omit_thinking=self._omit_thinking
            )
        )
        reason, sequence = stop_reason(self._finish, self._stop_string)
        final_usage = usage(self._prompt_tokens, tally.cached_tokens, tally.completion_tokens, self._created)
        delta = {"stop_reason": tool_stop_reason(reason, self._blocks.num_calls), "stop_sequence": sequence}
        yield event("message_delta", {"type": "message_delta", "delta": delta, "usage": final_usage})

    def final(self, tally: Tally) -> str:
        return event("message_stop", {"type": "message_stop"})

    def failure(self, err: APIError) -> list[str]:
        return [error_event(err, self._request_id)]
