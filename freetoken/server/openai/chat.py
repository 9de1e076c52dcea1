"""`POST /v1/chat/completions`: an OpenAI chat request in the core's terms, and its answers.

Owns `chat_input` (the request as the recipe's `ChatInput`: template messages, tools,
`reasoning_effort` as thinking on or off, `prompt_cache_key` marks, logprobs, `n`, `no_stop_trim`,
`logit_bias` ids checked once the vocabulary is known; no max_tokens means the rest of the context) and the `chat.completion` body
and `chat.completion.chunk` stream built from the core's results and pieces, logprobs included.
Rendering, limits, sampling and admission are the recipe's (core/recipe.py), running the choices
core/run.py's; tool calls and reasoning are parsed by the core's tool handling and shaped by
`tool_shapes`.
"""

from __future__ import annotations

import time
import uuid
from functools import partial
from typing import Any

from fastapi.responses import JSONResponse, Response

from freetoken.server.context import ServingContext
from freetoken.server.core.generation import ChoiceResult, Clock, Piece
from freetoken.server.core.logprobs import chat_logprobs
from freetoken.server.core.recipe import ChatInput, prepare_chat
from freetoken.server.core.run import start
from freetoken.server.core.streaming import DataFraming, Tally, sse_response
from freetoken.server.core.tool_calling import ToolCalling, openai_tool_options
from freetoken.server.openai.pins import openai_pin_marks
from freetoken.server.openai.protocol import ChatCompletionRequest, logit_bias_pairs
from freetoken.server.openai.tool_shapes import finish_reason, openai_delta, openai_message
from freetoken.server.sampling_defaults import left_out

ENDPOINT = "chat"


def chat_input(req: ChatCompletionRequest) -> ChatInput:
    """The request in the core's terms; a 400 naming the field for a value it cannot take."""
    req.check_messages()
    max_tokens = req.requested_max_tokens()
    params = req.sampling_params(1 if max_tokens is None else max_tokens, logprobs=req.logprobs_k())
    tools = openai_tool_options(req.tools, req.tool_choice, req.parallel_tool_calls)
    messages = req.template_messages()
    return ChatInput(
        messages=messages,
        params=params,
        max_tokens=max_tokens,
        tools=tools,
        pins=openai_pin_marks(messages, req.prompt_cache_key, req.prompt_cache_retention),
        num_choices=req.num_choices,
        include_stop=bool(req.no_stop_trim),
        max_param=req.max_param,
        check_vocab=partial(logit_bias_pairs, req.logit_bias),
        thinking=req.thinking(),
        unset=left_out(req),
    )


async def create_chat_completion(ctx: ServingContext, req: ChatCompletionRequest, request_id: str) -> Response:
    clock = Clock()
    prepared = await prepare_chat(ctx, chat_input(req))
    response_id = f"chatcmpl-{uuid.uuid4().hex}"
    run = start(ctx, ENDPOINT, prepared, request_id, response_id, clock)
    head = {"id": response_id, "object": "chat.completion", "created": int(time.time()), "model": ctx.served_name}
    with_logprobs = prepared.params.logprobs is not None
    if not req.stream:
        results = await run.collect()
        choices = [chat_choice(ctx, j, res, prepared.tooling, with_logprobs) for j, res in enumerate(results)]
        return JSONResponse({**head, "choices": choices, "usage": run.tally.usage(ctx.config.enable_cache_report)})
    first = await run.first()
    stream = ChatChunks(ctx, head, prepared.tooling, prepared.num_choices, with_logprobs, req.include_usage)
    framing = DataFraming(stream.preamble(), stream.chunks, stream.usage_chunk if req.include_usage else None)
    return sse_response(run.events(first, framing))


def chat_choice(
    ctx: ServingContext, index: int, res: ChoiceResult, tooling: ToolCalling, with_logprobs: bool
) -> dict[str, Any]:
    """One choice of a `chat.completion` body: its message (content, reasoning, tool calls)."""
    out = tooling.parse(res.text)
    return {
        "index": index,
        "message": openai_message(out),
        "logprobs": {"content": chat_logprobs(ctx.tokenizer, res.logprobs)} if with_logprobs else None,
        "finish_reason": finish_reason(res.finish_reason, len(out.tool_calls)),
    }


class ChatChunks:
    """The `chat.completion.chunk` objects of one streamed request: a role chunk per choice,
    then each piece's delta (parsed for tool calls and reasoning as it comes), and the usage
    chunk when `stream_options.include_usage` asked for it (then every chunk has `usage: null`)."""

    def __init__(
        self,
        ctx: ServingContext,
        head: dict[str, Any],
        tooling: ToolCalling,
        n: int,
        with_logprobs: bool,
        include_usage: bool,
    ) -> None:
        self._ctx = ctx
        self._head = {**head, "object": "chat.completion.chunk"}
        self._n = n
        self._with_logprobs = with_logprobs
        self._include_usage = include_usage
        self._parsers = [tooling.stream(incremental=True) for _ in range(n)]

    def chunk(self, index: int, delta: dict[str, Any], logprobs: Any, finish: str | None) -> dict[str, Any]:
        out = {
            **self._head,
            "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}],
        }
        if self._include_usage:
            out["usage"] = None
        return out

    def preamble(self) -> list[dict[str, Any]]:
        return [self.chunk(j, {"role": "assistant", "content": ""}, None, None) for j in range(self._n)]

    def chunks(self, piece: Piece) -> list[dict[str, Any]]:
        logprobs = {"content": chat_logprobs(self._ctx.tokenizer, piece.logprobs)} if self._with_logprobs else None
        parser = self._parsers[piece.index]
        parsed = parser.feed(piece.text)
        if piece.finish_reason is not None:
            parsed.extend(parser.finish())
        delta = openai_delta(parsed)
        finish = finish_reason(piece.finish_reason, parser.num_calls)
        if not delta and finish is None and not (logprobs and logprobs["content"]):
            return []
        return [self.chunk(piece.index, delta, logprobs, finish)]

    def usage_chunk(self, tally: Tally) -> dict[str, Any]:
        return {**self._head, "choices": [], "usage": tally.usage(self._ctx.config.enable_cache_report)}
