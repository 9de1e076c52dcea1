"""The server-sent event stream of one streamed Responses request.

Owns `ResponseFraming` and `response_events` (core/streaming.py's `event_stream` in this
framing): `response.created`, `response.in_progress`, the item events of
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

import itertools
import json
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any

from freetoken.server.context import ServingContext
from freetoken.server.errors import APIError
from freetoken.server.core.generation import Clock, Piece
from freetoken.server.core.streaming import Tally, event_stream
from freetoken.server.core.tool_calling import ToolStream
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


class ResponseFraming:
    """The Responses events of one streamed response (core/streaming.py's `Framing`), numbered
    from 0 by `sequence_number`."""

    def __init__(
        self,
        parser: ToolStream,
        body: BodyOf,
        usage_of: Callable[[Tally], dict[str, Any]],
        on_done: Callable[[dict[str, Any], list[int]], None],
        seal_reasoning: bool,
        logprobs_of: Callable[[Piece], list[dict[str, Any]]] | None,
    ) -> None:
        self._parser = parser
        self._body = body
        self._usage_of = usage_of
        self._on_done = on_done
        self._logprobs_of = logprobs_of
        self._seq = itertools.count()
        self._items = OutputItems(seal_reasoning=seal_reasoning)
        self._token_ids: list[int] = []
        self._finish: str | None = None

    def _emit(self, event: dict[str, Any]) -> str:
        return frame({**event, "sequence_number": next(self._seq)})

    def opening(self, first: Piece | None) -> list[str]:
        return [
            self._emit({"type": "response.created", "response": self._body("in_progress", [], None)}),
            self._emit({"type": "response.in_progress", "response": self._body("in_progress", [], None)}),
        ]

    def piece(self, piece: Piece) -> Iterator[str]:
        self._token_ids += piece.token_ids
        if piece.finish_reason is not None:
            self._finish = piece.finish_reason
        for event in feed_piece(self._items, self._parser, piece, self._logprobs_of):
            yield self._emit(event)

    def closing(self, tally: Tally) -> Iterator[str]:
        for event in self._items.finish(self._finish == "length"):
            yield self._emit(event)

    def final(self, tally: Tally) -> str:
        incomplete = self._finish == "length"
        final = self._body("incomplete" if incomplete else "completed", self._items.items, self._usage_of(tally))
        self._on_done(final, self._token_ids)
        return self._emit({"type": "response.incomplete" if incomplete else "response.completed", "response": final})

    def failure(self, err: APIError) -> list[str]:
        failed = self._body("failed", self._items.items, None)
        failed["error"] = {"code": "server_error", "message": err.message}
        return [
            self._emit({"type": "error", "code": err.code, "message": err.message, "param": err.param}),
            self._emit({"type": "response.failed", "response": failed}),
        ]


def response_events(
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
    framing = ResponseFraming(parser, body, usage_of, on_done, seal_reasoning, logprobs_of)
    return event_stream(ctx, endpoint, pieces, first, tally=tally, clock=clock, framing=framing)
