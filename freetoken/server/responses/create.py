"""`POST /v1/responses`: one response, generated and answered (its reads are in routes.py).

Owns the OpenAI Responses route over the shared generation core: `response_turn` makes the
request's items, tools and `text.format` (via `items` / `tools`) the recipe's `ChatInput`, with
the earlier turn of `previous_response_id` before them and its exact tokens spliced in by
`prompt`; the recipe (core/recipe.py) prepares it and core/run.py runs it as one choice with the
core's tool parsing and forced-call grammar; `Answer` writes the `response` object (whole, or as
the event stream of `stream`) and keeps the finished response in the `ResponseStore` unless
`store` is false. Hosted tool types left out of the prompt are named in the
`x-freetoken-ignored-tools` header and a log line.
"""

from __future__ import annotations

import logging
import time
from array import array
from dataclasses import dataclass
from typing import Any

from fastapi.responses import JSONResponse, Response

from freetoken.request import SamplingParams
from freetoken.server.context import ServingContext
from freetoken.server.core.chat_prompt import Prompt
from freetoken.server.core.generation import Clock, Piece
from freetoken.server.core.logprobs import chat_logprobs
from freetoken.server.core.recipe import ChatInput, prepare_chat
from freetoken.server.core.run import start
from freetoken.server.core.streaming import Tally, sse_response
from freetoken.server.errors import APIError, bad_request
from freetoken.server.responses.items import call_names, items_to_messages, listed_items
from freetoken.server.responses.output import new_id, response_body, usage
from freetoken.server.responses.prompt import build_prompt
from freetoken.server.responses.protocol import ResponsesRequest
from freetoken.server.responses.store import ResponseStore, StoredResponse
from freetoken.server.responses.stream import collected_items, response_events
from freetoken.server.responses.tools import ResponsesTools, responses_tools, text_grammar
from freetoken.server.sampling_defaults import left_out
from freetoken.weights.sampling_defaults import SamplingDefaults

log = logging.getLogger(__name__)

ENDPOINT = "responses"
IGNORED_TOOLS_HEADER = "x-freetoken-ignored-tools"


def echo_fields(req: ResponsesRequest, tools: ResponsesTools, defaults: SamplingDefaults) -> dict[str, Any]:
    """The request fields a `response` object repeats (`temperature` / `top_p` as sampled: the
    model's defaults where the request left them out)."""
    sampled = defaults.apply(SamplingParams(), left_out(req))
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
        "temperature": sampled.temperature if req.temperature is None else req.temperature,
        "text": text,
        "tool_choice": "auto" if req.tool_choice is None else req.tool_choice,
        "tools": list(tools.echo),
        "top_p": sampled.top_p if req.top_p is None else req.top_p,
        "truncation": req.truncation or "disabled",
        "user": req.user,
    }


@dataclass(frozen=True)
class Turn:
    """A Responses request in the core's terms, with what its answer and its stored entry need."""

    chat: ChatInput
    tools: ResponsesTools
    kept: list[dict[str, Any]]  # the conversation a later turn continues: the earlier one + this input
    inputs: tuple[dict[str, Any], ...]  # this input's items, as `input_items` lists them


def response_turn(req: ResponsesRequest, store: ResponseStore) -> Turn:
    """The request in the core's terms, after the stored turn it continues (a 404 when that is
    gone); a 400 naming the field for a value it cannot take."""
    prior = None
    if req.previous_response_id is not None:
        prior = store.get(req.previous_response_id)
        if prior is None:
            raise APIError(
                404,
                f"Previous response with id '{req.previous_response_id}' not found.",
                param="previous_response_id",
                code="previous_response_not_found",
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
    params = req.sampling_params(1, grammar)  # range checks before any rendering
    instructions = [{"role": "system", "content": req.instructions}] if req.instructions else []
    output_at = len(instructions) + len(history) - 1 if prior is not None and prior.plain_output else None
    chat = ChatInput(
        messages=instructions + history + conversation.messages,
        params=params,
        max_tokens=req.max_output_tokens,
        tools=tools.options,
        thinking=req.thinking(),
        prompt_param="input",
        max_param="max_output_tokens",
        render=lambda tokenizer, tooling, messages: build_prompt(tokenizer, tooling, messages, prior, output_at),
        unset=left_out(req),
    )
    return Turn(chat, tools, history + conversation.messages, tuple(listed_items(req.input)))


async def create_response(
    ctx: ServingContext, store: ResponseStore, req: ResponsesRequest, request_id: str
) -> Response:
    clock = Clock()
    turn = response_turn(req, store)
    prepared = await prepare_chat(ctx, turn.chat)
    response_id = new_id("resp")
    run = start(ctx, ENDPOINT, prepared, request_id, response_id, clock)
    answer = Answer(ctx, req, store, turn, prepared.prompt, response_id)
    headers = {IGNORED_TOOLS_HEADER: ",".join(turn.tools.ignored)} if turn.tools.ignored else {}
    if not req.stream:
        result = (await run.collect())[0]
        incomplete = result.finish_reason == "length"
        items = collected_items(  # fed as the stream feeds them: the streamed items and logprobs
            result.pieces,
            prepared.tooling.stream(incremental=True),
            incomplete=incomplete,
            seal_reasoning=req.seals_reasoning,
            logprobs_of=answer.logprobs_of,
        )
        final = answer.body("incomplete" if incomplete else "completed", items.items, answer.usage_of(run.tally))
        answer.keep(final, result.token_ids)
        return JSONResponse(final, headers=headers)
    first = await run.first()
    events = response_events(
        ctx,
        ENDPOINT,
        run.pieces,
        first,
        tally=run.tally,
        clock=clock,
        parser=prepared.tooling.stream(incremental=True),
        body=answer.body,
        usage_of=answer.usage_of,
        on_done=answer.keep,
        seal_reasoning=req.seals_reasoning,
        logprobs_of=answer.logprobs_of,
    )
    response = sse_response(events)
    response.headers.update(headers)
    return response


class Answer:
    """How one response is written: its `response` object at each status, its usage, its tokens'
    logprobs (when asked), and its entry in the store (unless `store` is false)."""

    def __init__(
        self,
        ctx: ServingContext,
        req: ResponsesRequest,
        store: ResponseStore,
        turn: Turn,
        prompt: Prompt,
        response_id: str,
    ) -> None:
        self._ctx = ctx
        self._store = store if req.stores else None
        self._turn = turn
        self._prompt = prompt
        self._id = response_id
        self._created = int(time.time())
        self._echo = echo_fields(req, turn.tools, ctx.sampling_defaults)
        self.logprobs_of = None if req.logprobs_k() is None else self._logprobs

    def body(self, status: str, output: list[dict[str, Any]], usage_doc: dict[str, Any] | None) -> dict[str, Any]:
        incomplete = "max_output_tokens" if status == "incomplete" else None
        return response_body(
            self._id,
            self._created,
            self._ctx.served_name,
            self._echo,
            status=status,
            output=output,
            usage_doc=usage_doc,
            incomplete_reason=incomplete,
        )

    def usage_of(self, tally: Tally) -> dict[str, Any]:
        return usage(tally.prompt_tokens, tally.completion_tokens, tally.cached_tokens)

    def _logprobs(self, piece: Piece) -> list[dict[str, Any]]:
        return chat_logprobs(self._ctx.tokenizer, piece.logprobs)

    def keep(self, final: dict[str, Any], output_ids: list[int]) -> None:
        if self._store is not None:
            self._store.put(self._id, stored(final, self._turn.kept, self._prompt, output_ids, self._turn.inputs))


def stored(
    final: dict[str, Any],
    messages: list[dict[str, Any]],
    prompt: Prompt,
    output_ids: list[int],
    inputs: tuple[dict[str, Any], ...],
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
