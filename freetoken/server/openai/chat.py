"""`POST /v1/chat/completions`: messages -> the model's chat template -> engine choices.

Owns the chat route over the shared core: the request's messages rendered by
`core.chat_prompt.render_chat` (template, message boundaries), the default `max_tokens` (the rest
of the context) and the `chat.completion` bodies and stream chunks, logprobs included. Tool
calling (prompt, grammar, parsing) is `core.tool_calling`'s; its results are shaped by
`tool_shapes` and placed in the bodies and chunks here.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import replace
from typing import Any

import anyio.to_thread
from fastapi.responses import JSONResponse, Response

from freetoken.server.context import ServingContext
from freetoken.server.core.chat_prompt import render_chat
from freetoken.server.core.generation import ChoiceSpec, Clock, Piece, collect, first_piece, merge, run_choice
from freetoken.server.core.limits import check_context, check_max_tokens
from freetoken.server.core.logprobs import chat_logprobs
from freetoken.server.core.streaming import Tally, record, sse_response, sse_stream
from freetoken.server.core.tool_calling import ToolCalling, openai_tool_options
from freetoken.server.errors import bad_request
from freetoken.server.openai.pins import openai_pins
from freetoken.server.openai.protocol import ChatCompletionRequest
from freetoken.server.openai.tool_shapes import finish_reason, openai_delta, openai_message
from freetoken.server.request_hygiene import engine_rid

ENDPOINT = "chat"


async def create_chat_completion(ctx: ServingContext, req: ChatCompletionRequest, request_id: str) -> Response:
    clock = Clock()
    req.check_common()
    ctx.check_model(req.model)
    if not req.messages:
        raise bad_request("messages must not be empty", param="messages")
    requested = req.requested_max_tokens()
    max_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    check_max_tokens(requested, max_param)
    logprobs_k = req.logprobs_k()
    req.sampling_params(1 if requested is None else requested, logprobs=logprobs_k)  # range checks first
    info = ctx.ready_info()
    tooling = ToolCalling(ctx, openai_tool_options(req.tools, req.tool_choice, req.parallel_tool_calls))
    template_messages = req.template_messages()
    ids, boundaries = await anyio.to_thread.run_sync(  # template + tokenizer: off the event loop
        render_chat, ctx.tokenizer, *tooling.template_inputs(template_messages), tooling.template_context()
    )
    pins = openai_pins(template_messages, boundaries, req.prompt_cache_key, req.prompt_cache_retention)
    max_tokens = requested if requested is not None else info.context_length - len(ids)
    check_context(len(ids), max(max_tokens, 1), info.context_length, prompt_param="messages", max_param=max_param)
    base = tooling.sampling(req.sampling_params(max_tokens, logprobs=logprobs_k, vocab_size=info.vocab_size))
    n = req.num_choices
    ctx.check_capacity(n)
    response_id = f"chatcmpl-{uuid.uuid4().hex}"
    eos = frozenset(ctx.tokenizer.stop_ids)
    specs = [
        ChoiceSpec(
            j, engine_rid(request_id, response_id, j), ids, base if base.seed is None or j == 0 else replace(base, seed=base.seed + j), eos, boundaries,
            include_stop=bool(req.no_stop_trim), pins=pins,
        )
        for j in range(n)
    ]
    tally = Tally([len(ids)], [0] * n)
    pieces = merge([run_choice(ctx.client, spec, ctx.tokenizer) for spec in specs])
    head = {"id": response_id, "object": "chat.completion", "created": int(time.time()), "model": ctx.served_name}

    if not req.stream:
        results = await collect(ctx.client, pieces, n, clock)
        tally.add_results(results)
        parsed = [tooling.parse(res.text) for res in results]
        choices = [
            {
                "index": j,
                "message": openai_message(out),
                "logprobs": None if logprobs_k is None else {"content": chat_logprobs(ctx.tokenizer, res.logprobs)},
                "finish_reason": finish_reason(res.finish_reason, len(out.tool_calls)),
            }
            for j, (res, out) in enumerate(zip(results, parsed))
        ]
        record(ctx, ENDPOINT, 200, tally, clock)
        return JSONResponse({**head, "choices": choices, "usage": tally.usage(ctx.config.enable_cache_report)})

    first = await first_piece(ctx.client, pieces)
    include_usage = req.include_usage
    chunk_head = {**head, "object": "chat.completion.chunk"}

    def chunk(index: int, delta: dict[str, Any], logprobs: Any, finish: str | None) -> dict[str, Any]:
        out = {**chunk_head, "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}
        if include_usage:
            out["usage"] = None
        return out

    preamble = [chunk(j, {"role": "assistant", "content": ""}, None, None) for j in range(n)]
    parsers = [tooling.stream(incremental=True) for _ in range(n)]

    def chunks(piece: Piece) -> list[dict[str, Any]]:
        logprobs = None
        if logprobs_k is not None:
            logprobs = {"content": chat_logprobs(ctx.tokenizer, piece.logprobs)}
        parser = parsers[piece.index]
        parsed = parser.feed(piece.text)
        if piece.finish_reason is not None:
            parsed.extend(parser.finish())
        delta = openai_delta(parsed)
        finish = finish_reason(piece.finish_reason, parser.num_calls)
        if not delta and finish is None and not (logprobs and logprobs["content"]):
            return []
        return [chunk(piece.index, delta, logprobs, finish)]

    def usage_chunk(t: Tally) -> dict[str, Any]:
        return {**chunk_head, "choices": [], "usage": t.usage(ctx.config.enable_cache_report)}

    events = sse_stream(
        ctx, ENDPOINT, pieces, first, tally=tally, clock=clock, preamble=preamble, chunks=chunks,
        usage_chunk=usage_chunk if include_usage else None,
    )
    return sse_response(events)
