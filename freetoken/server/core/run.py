"""A prepared request on the engine: its choices as one stream of text pieces.

Owns `Run` and `start`: one engine choice per prompt and `n` (choice `p * n + j`, its engine id
holding the request id, its seed `seed + j`), their pieces merged as they come, and the request's
tally and clock; `Run.collect` for a whole response (the request's metrics recorded as it ends),
`Run.first` then `Run.events` for a stream (the first piece before the headers go out, so that a
refusal is still an HTTP error; then the protocol's framing of the pieces, core/streaming.py),
its tokens counted in the dashboard's tok/s as they come (`metered`). Starting a run sends
nothing: the engine sees the request when its pieces are first read. Response bodies and stream events are the protocols'; this module builds none.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

from freetoken.request import SamplingParams
from freetoken.server.context import ServingContext
from freetoken.server.operations.activity import Throughput
from freetoken.server.core.generation import (
    ChoiceResult,
    ChoiceSpec,
    Clock,
    Piece,
    _close,
    collect,
    first_piece,
    merge,
    run_choice,
)
from freetoken.server.core.recipe import Prepared
from freetoken.server.core.streaming import Framing, Tally, event_stream, record
from freetoken.server.request_hygiene import engine_rid


@dataclass
class Run:
    ctx: ServingContext
    endpoint: str  # the metrics' name for the route
    specs: list[ChoiceSpec]
    pieces: AsyncIterator[Piece]
    tally: Tally
    clock: Clock

    async def collect(self) -> list[ChoiceResult]:
        """Every choice whole (an engine error in any is the response's APIError); the request's
        usage tallied and its metrics recorded."""
        results = await collect(self.ctx.client, self.pieces, len(self.specs), self.clock)
        self.tally.add_results(results)
        record(self.ctx, self.endpoint, 200, self.tally, self.clock)
        return results

    async def first(self) -> Piece | None:
        return await first_piece(self.ctx.client, self.pieces)

    def events(self, first: Piece | None, framing: Framing) -> AsyncIterator[str]:
        """The request's stream in `framing`'s events (its metrics recorded as it ends)."""
        return event_stream(
            self.ctx, self.endpoint, self.pieces, first, tally=self.tally, clock=self.clock, framing=framing
        )


def seeded(params: SamplingParams, choice: int) -> SamplingParams:
    """Choice `j` of a seeded request samples with `seed + j`."""
    return params if params.seed is None or choice == 0 else replace(params, seed=params.seed + choice)


async def metered(
    pieces: AsyncIterator[Piece], specs: list[ChoiceSpec], throughput: Throughput
) -> AsyncIterator[Piece]:
    """`pieces` as they come, their tokens counted in the dashboard's tok/s: a choice's prompt
    past its cache hit as prefill when its first piece comes, every generated token as decode.
    Closing this closes (aborts) `pieces`."""
    started = [False] * len(specs)
    try:
        async for piece in pieces:
            prefill = 0
            if not started[piece.index]:
                started[piece.index] = True
                prefill = max(0, len(specs[piece.index].prompt_ids) - piece.report.cached_tokens)
            throughput.add(prefill=prefill, decode=len(piece.token_ids))
            yield piece
    finally:
        await _close(pieces)


def start(
    ctx: ServingContext, endpoint: str, prepared: Prepared, request_id: str, response_id: str, clock: Clock
) -> Run:
    n = prepared.num_choices
    eos = frozenset(ctx.tokenizer.stop_ids)
    specs = [
        ChoiceSpec(
            p * n + j,
            engine_rid(request_id, response_id, p * n + j),
            prompt.ids,
            seeded(prepared.params, j),
            eos,
            prompt.boundaries,
            include_stop=prepared.include_stop,
            pins=prepared.pins,
        )
        for p, prompt in enumerate(prepared.prompts)
        for j in range(n)
    ]
    tally = Tally([len(prompt.ids) for prompt in prepared.prompts], [spec.index // n for spec in specs], request_id)
    pieces = metered(
        merge([run_choice(ctx.client, spec, ctx.tokenizer) for spec in specs]), specs, ctx.activity.throughput
    )
    return Run(ctx, endpoint, specs, pieces, tally, clock)
