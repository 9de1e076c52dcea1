"""`POST /v1/responses`: one response, generated and answered (its reads are in routes.py).

Owns the OpenAI Responses route over the shared generation core: the request's items, tools and
`text.format` (via `items` / `tools`) become a chat conversation, rendered
(and, after `previous_response_id`, spliced) by `prompt`, generated as one choice by
`core.generation.run_choice` with the core's tool parsing and forced-call grammar, and answered as
a `response` object or as the event stream of `stream`. Finished responses are kept in
the `ResponseStore` unless `store` is false. Hosted tool types left out of the prompt are named in
the `x-freetoken-ignored-tools` header and a log line.
"""

from __future__ import annotations

import logging
import time
from array import array
from typing import Any

import anyio.to_thread
from fastapi.responses import JSONResponse, Response

from freetoken.server.context import ServingContext
from freetoken.server.core.errors import APIError, bad_request
from freetoken.server.core.generation import ChoiceSpec, Clock, Piece, collect, first_piece, merge, run_choice
from freetoken.server.core.limits import check_context
from freetoken.server.core.logprobs import chat_logprobs
from freetoken.server.core.streaming import Tally, record, sse_response
from freetoken.server.core.tool_calling import ToolCalling
from freetoken.server.request_hygiene import engine_rid
from freetoken.server.responses.items import call_names, items_to_messages, listed_items
from freetoken.server.responses.output import new_id, response_body, usage
from freetoken.server.responses.prompt import Prompt, build_prompt
from freetoken.server.responses.protocol import ResponsesRequest
from freetoken.server.responses.store import ResponseStore, StoredResponse
from freetoken.server.responses.stream import collected_items, response_events
from freetoken.server.responses.tools import ResponsesTools, responses_tools, text_grammar

log = logging.getLogger(__name__)

ENDPOINT = "responses"
IGNORED_TOOLS_HEADER = "x-freetoken-ignored-tools"


def echo_fields(req: ResponsesRequest, tools: ResponsesTools) -> dict[str, Any]:
    """The request fields a `response` object repeats."""
    text = dict(req.text or {})
    text.setdefault("format", {"type": "text"})
    return {
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "metadata": req.metadata or {},
        "parallel_tool_calls": tools.options.parallel,
        "previous_response_id": req.previous_response_id,
        "prompt_cache_key": req.prompt_cache_key,
        "reasoning": req.reasoning or {"effort": None, "summary": None},
        "store": req.stores,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "text": text,
        "tool_choice": "auto" if req.tool_choice is None else req.tool_choice,
        "tools": list(tools.echo),
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "truncation": req.truncation or "disabled",
        "user": req.user,
    }


async def create_response(ctx: ServingContext, store: ResponseStore, req: ResponsesRequest, request_id: str) -> Response:
    clock = Clock()
    req.check()
    ctx.check_model(req.model)
    prior = None
    if req.previous_response_id is not None:
        prior = store.get(req.previous_response_id)
        if prior is None:
            raise APIError(
                404, f"Previous response with id '{req.previous_response_id}' not found.",
                param="previous_response_id", code="previous_response_not_found",
            )
    tools = responses_tools(req.tools, req.tool_choice, req.parallel_tool_calls)
    grammar = text_grammar(req.text)
    history = list(prior.messages) if prior is not None else []
    conversation = items_to_messages(req.input, names=call_names(history))
    if not history and not conversation.messages:
        raise bad_request("input must not be empty", param="input")
    if conversation.dropped:
        log.info("response input: left out items of hosted tools: %s", ", ".join(sorted(set(conversation.dropped))))
    if tools.ignored:
        log.info("response tools: left out hosted tool types this server cannot run: %s", ", ".join(tools.ignored))
    req.sampling_params(1, grammar)  # range checks before any rendering
    info = ctx.ready_info()
    tooling = ToolCalling(ctx, tools.options, thinking=req.thinking())
    instructions = [{"role": "system", "content": req.instructions}] if req.instructions else []
    output_at = len(instructions) + len(history) - 1 if prior is not None and prior.plain_output else None
    prompt = await anyio.to_thread.run_sync(  # template + tokenizer: off the event loop
        build_prompt, ctx.tokenizer, tooling, instructions + history + conversation.messages, prior, output_at
    )
    max_tokens = req.max_output_tokens if req.max_output_tokens is not None else info.context_length - len(prompt.ids)
    check_context(len(prompt.ids), max(max_tokens, 1), info.context_length, prompt_param="input", max_param="max_output_tokens")
    params = tooling.sampling(req.sampling_params(max_tokens, grammar))
    ctx.check_capacity(1)
    response_id = new_id("resp")
    spec = ChoiceSpec(0, engine_rid(request_id, response_id, 0), prompt.ids, params, frozenset(ctx.tokenizer.stop_ids), prompt.boundaries)
    tally = Tally([len(prompt.ids)], [0])
    pieces = merge([run_choice(ctx.client, spec, ctx.tokenizer)])
    created = int(time.time())
    echo = echo_fields(req, tools)
    headers = {IGNORED_TOOLS_HEADER: ",".join(tools.ignored)} if tools.ignored else {}
    kept = history + conversation.messages
    inputs = tuple(listed_items(req.input))

    def body(status: str, output: list[dict[str, Any]], usage_doc: dict[str, Any] | None) -> dict[str, Any]:
        incomplete = "max_output_tokens" if status == "incomplete" else None
        return response_body(
            response_id, created, ctx.served_name, echo, status=status, output=output, usage_doc=usage_doc, incomplete_reason=incomplete
        )

    def usage_of(t: Tally) -> dict[str, Any]:
        return usage(t.prompt_tokens, t.completion_tokens, t.cached_tokens)

    def piece_logprobs(piece: Piece) -> list[dict[str, Any]]:
        return chat_logprobs(ctx.tokenizer, piece.logprobs)

    logprobs_of = None if req.logprobs_k() is None else piece_logprobs

    def keep(final: dict[str, Any], output_ids: list[int]) -> None:
        if req.stores:
            store.put(response_id, stored(final, kept, prompt, output_ids, inputs))

    if not req.stream:
        result = (await collect(ctx.client, pieces, 1, clock))[0]
        tally.add_results([result])
        incomplete = result.finish_reason == "length"
        items = collected_items(  # fed as the stream feeds them: the streamed items and logprobs
            result.pieces, tooling.stream(incremental=True), incomplete=incomplete, seal_reasoning=req.seals_reasoning,
            logprobs_of=logprobs_of,
        )
        final = body("incomplete" if incomplete else "completed", items.items, usage_of(tally))
        keep(final, result.token_ids)
        record(ctx, ENDPOINT, 200, tally, clock)
        return JSONResponse(final, headers=headers)

    first = await first_piece(ctx.client, pieces)
    events = response_events(
        ctx, ENDPOINT, pieces, first, tally=tally, clock=clock, parser=tooling.stream(incremental=True), body=body, usage_of=usage_of, on_done=keep,
        seal_reasoning=req.seals_reasoning, logprobs_of=logprobs_of,
    )
    response = sse_response(events)
    response.headers.update(headers)
    return response


def stored(
    final: dict[str, Any], messages: list[dict[str, Any]], prompt: Prompt, output_ids: list[int], inputs: tuple[dict[str, Any], ...]
) -> StoredResponse:
    """What a later turn needs: the conversation (with this response's output as messages) and the exact tokens."""
    output = items_to_messages(final["output"], "output", names=call_names(messages)).messages
    return StoredResponse(
        body=final,
        messages=tuple(messages + output),
        prompt_text=prompt.text,
        prompt_ids=array("i", prompt.ids),
        output_ids=array("i", output_ids),
        boundaries=prompt.boundaries,
        plain_output=[item["type"] for item in final["output"]] == ["message"],
        input_items=inputs,
    )
