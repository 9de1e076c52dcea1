"""The server-sent event stream of one streamed Responses request.

Owns `response_events`: `response.created`, `response.in_progress`, the item events of
`OutputItems` as the model writes (with each piece's token logprobs when asked), then `response.completed` (or `response.incomplete` when
`max_output_tokens` cut it), every event framed as `event: TYPE` + `data: {...}` with a
`sequence_number` counting from 0, and no `[DONE]` (OpenAI sends none on this route). An engine
failure after the stream started is an `error` event followed by `response.failed`; a client that
goes away aborts the request. Metrics are recorded when the stream ends. Bodies come from the
callbacks the route passes in. Also `collected_items`, a non-streamed response's output: the same
pieces through the same `feed_piece`, so it has the streamed items and logprobs (those of reasoning
and call tokens are left out on both paths; `output_text` has the only place for logprobs).
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from freetoken.errors import FreeTokenError
from freetoken.server.context import ServingContext
from freetoken.server.core.generation import Clock, Piece, closing, engine_error, failed_choice
from freetoken.server.core.streaming import CLIENT_CLOSED, Tally, record
from freetoken.server.core.tool_calling import ToolStream
from freetoken.server.errors import APIError
from freetoken.server.responses.output import OutputItems

# (status, output items, usage or None) -> the `response` object
BodyOf = Callable[[str, list[dict[str, Any]], "dict[str, Any] | None"], dict[str, Any]]


def feed_piece(
    items: OutputItems, parser: ToolStream, piece: Piece, logprobs_of: Callable[[Piece], list[dict[str, Any]]] | None
) -> list[dict[str, Any]]:
    """One piece through the parser (finished with the choice's last piece) into `items`, with its
    tokens' logprobs when asked. Both paths build their items this way, so a non-streamed response
    has the streamed one's items and logprobs."""
    delta = parser.feed(piece.text)
    if piece.finish_reason is not None:
        delta.extend(parser.finish())
    return items.feed(delta, logprobs_of(piece) if logprobs_of is not None else None)


def collected_items(
    pieces: Sequence[Piece],
    parser: ToolStream,
    *,
    incomplete: bool,
    seal_reasoning: bool = False,
    logprobs_of: Callable[[Piece], list[dict[str, Any]]] | None = None,
) -> OutputItems:
    """A non-streamed response's output: its pieces fed as the stream feeds them, then closed."""
    items = OutputItems(seal_reasoning=seal_reasoning)
    for piece in pieces:
        feed_piece(items, parser, piece, logprobs_of)
    items.finish(incomplete)
    return items


def frame(event: dict[str, Any]) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def response_events(
    ctx: ServingContext,
    endpoint: str,
    pieces: AsyncIterator[Piece],
    first: Piece | None,
    *,
    tally: Tally,
    clock: Clock,
    parser: ToolStream,
    body: BodyOf,
    usage_of: Callable[[Tally], dict[str, Any]],
    on_done: Callable[[dict[str, Any], list[int]], None],
    seal_reasoning: bool = False,
    logprobs_of: Callable[[Piece], list[dict[str, Any]]] | None = None,
) -> AsyncIterator[str]:
    """The whole event stream (the first piece already taken, see `generation.first_piece`);
    `on_done(final body, output token ids)` runs before the last event goes out."""
    seq = itertools.count()

    def emit(event: dict[str, Any]) -> str:
        return frame({**event, "sequence_number": next(seq)})

    status = CLIENT_CLOSED
    items = OutputItems(seal_reasoning=seal_reasoning)
    token_ids: list[int] = []
    finish: str | None = None
    async with closing(pieces):
        try:
            yield emit({"type": "response.created", "response": body("in_progress", [], None)})
            yield emit({"type": "response.in_progress", "response": body("in_progress", [], None)})
            piece = first
            while piece is not None:
                clock.saw(piece)
                tally.add(piece)
                if piece.error is not None:
                    err = failed_choice(ctx.client, piece.error)
                    status = err.status
                    for line in _failure(err, body, items, emit):
                        yield line
                    return
                token_ids += piece.token_ids
                if piece.finish_reason is not None:
                    finish = piece.finish_reason
                for event in feed_piece(items, parser, piece, logprobs_of):
                    yield emit(event)
                try:
                    piece = await anext(pieces)
                except StopAsyncIteration:
                    piece = None
            incomplete = finish == "length"
            for event in items.finish(incomplete):
                yield emit(event)
            final = body("incomplete" if incomplete else "completed", items.items, usage_of(tally))
            on_done(final, token_ids)
            status = 200
            yield emit({"type": "response.incomplete" if incomplete else "response.completed", "response": final})
        except FreeTokenError as exc:
            err = engine_error(ctx.client, exc)
            status = err.status
            for line in _failure(err, body, items, emit):
                yield line
        except asyncio.CancelledError:
            status = CLIENT_CLOSED
            raise
        finally:
            record(ctx, endpoint, status, tally, clock)


def _failure(err: APIError, body: BodyOf, items: OutputItems, emit: Callable[[dict[str, Any]], str]) -> list[str]:
    failed = body("failed", items.items, None)
    failed["error"] = {"code": "server_error", "message": err.message}
    return [
        emit({"type": "error", "code": err.code, "message": err.message, "param": err.param}),
        emit({"type": "response.failed", "response": failed}),
    ]
