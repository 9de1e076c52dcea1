"""Server-sent event streams and usage accounting shared by the routes.

Owns `Tally` (prompt, completion and cache-hit tokens of one HTTP request, its speculative
drafts, its choices' finish reasons, and its `usage` object), the metrics and the dashboard's line
each request records when it ends (`record`), and `event_stream`: the one loop every streamed
response runs -- pieces counted as they come, a
failed choice or an engine failure after the stream started ending it with the protocol's error
event, a client that goes away aborting the request, the metrics recorded at the end -- with a
`Framing` that says how its protocol writes the events. `DataFraming` is the
`data: {...}` stream with `data: [DONE]` at the end that chat completions and completions share
(an engine failure: one `data: {"error": {...}}` event, and no `[DONE]`); Responses and Messages
bring framings of their own. Response bodies are built by the protocols.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from fastapi.responses import StreamingResponse

from freetoken.errors import FreeTokenError
from freetoken.request import CacheReport
from freetoken.server.context import ServingContext
from freetoken.server.errors import APIError
from freetoken.server.operations.activity import FinishedRequest
from freetoken.server.core.generation import (
    DONE_EVENT,
    ChoiceResult,
    Clock,
    Piece,
    _close,
    engine_error,
    failed_choice,
    sse,
)
from freetoken.server.operations.request_log import RequestEnd, log_request

CLIENT_CLOSED = 499  # the status recorded for a client that went away mid-stream


@dataclass
class Tally:
    """Token counts of one request. `choice_prompt[i]` is the prompt index of choice i;
    `request_id` and the choices' finish reasons are for the request's log line."""

    prompt_lens: list[int]
    choice_prompt: list[int]
    request_id: str = "-"
    completion: list[int] = field(default_factory=list)
    reports: list[CacheReport] = field(default_factory=list)  # per choice, so far
    finish: list[str | None] = field(default_factory=list)  # per choice: its finish reason, once it ended

    def __post_init__(self) -> None:
        self.completion = [0] * len(self.choice_prompt)
        self.reports = [CacheReport()] * len(self.choice_prompt)
        self.finish = [None] * len(self.choice_prompt)

    def add(self, piece: Piece) -> None:
        self.completion[piece.index] += len(piece.token_ids)
        self.reports[piece.index] = self.reports[piece.index].after(piece.report)
        if piece.finish_reason is not None:
            self.finish[piece.index] = piece.finish_reason

    def add_results(self, results: list[ChoiceResult]) -> None:
        for i, res in enumerate(results):
            self.completion[i] = len(res.token_ids)
            self.reports[i] = res.report
            self.finish[i] = res.finish_reason

    @property
    def prompt_tokens(self) -> int:
        return sum(self.prompt_lens)

    @property
    def completion_tokens(self) -> int:
        return sum(self.completion)

    @property
    def cached_tokens(self) -> int:
        """Per prompt the best hit among its choices (they share the prompt), summed over prompts."""
        best = [0] * len(self.prompt_lens)
        for i, p in enumerate(self.choice_prompt):
            best[p] = max(best[p], self.reports[i].cached_tokens)
        return sum(best)

    def prompt_misses(self) -> list[tuple[int, str | None]]:
        """Per prompt, the cache report of its best-hit choice: (matched tokens, miss reason)."""
        best: list[CacheReport | None] = [None] * len(self.prompt_lens)
        for i, p in enumerate(self.choice_prompt):
            r = best[p]
            if r is None or self.reports[i].cached_tokens > r.cached_tokens:
                best[p] = self.reports[i]
        return [(0, None) if r is None else (r.matched_tokens, r.miss_reason) for r in best]

    def usage(self, cache_report: bool) -> dict[str, Any]:
        out: dict[str, Any] = {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }
        if cache_report:
            misses = self.prompt_misses()
            reasons = [r for _, r in misses]
            out["prompt_tokens_details"] = {
                "cached_tokens": self.cached_tokens,
                "matched_tokens": sum(m for m, _ in misses),
                "miss_reason": reasons[0] if len(reasons) == 1 else reasons,
            }
        drafted = sum(r.drafted_tokens for r in self.reports)
        if drafted:  # --speculative: OpenAI's predicted-output counts (drafted tokens kept / thrown away)
            accepted = sum(r.accepted_tokens for r in self.reports)
            out["completion_tokens_details"] = {
                "accepted_prediction_tokens": accepted,
                "rejected_prediction_tokens": drafted - accepted,
            }
        return out


def record(ctx: ServingContext, endpoint: str, status: int, tally: Tally, clock: Clock) -> None:
    """The request's metrics and its log line, as it ends."""
    now = time.perf_counter()
    ctx.activity.finished(finished_request(endpoint, status, tally, clock, now))
    ttft_s = None if clock.first_token is None else clock.first_token - clock.start
    log_request(
        RequestEnd(
            endpoint,
            status,
            tally.request_id,
            tally.prompt_tokens,
            tally.cached_tokens,
            tally.completion_tokens,
            ttft_s,
            None if clock.first_token is None else now - clock.first_token,
            tally.finish,
        )
    )
    ctx.metrics.record_request(
        endpoint,
        status,
        prompt_tokens=tally.prompt_tokens if status == 200 else 0,
        completion_tokens=tally.completion_tokens,
        cached_tokens=tally.cached_tokens,
        miss_reasons=[r for _, r in tally.prompt_misses() if r is not None] if status == 200 else [],
        ttft_s=ttft_s,
        latency_s=now - clock.start if status == 200 else None,
    )


def finished_request(endpoint: str, status: int, tally: Tally, clock: Clock, now: float) -> FinishedRequest:
    """The dashboard's line for a request that ended (operations/activity.py)."""
    reasons = [r for r in dict.fromkeys(tally.finish) if r is not None]
    misses = tally.prompt_misses()
    return FinishedRequest(
        at=time.time(),
        endpoint=endpoint,
        status=status,
        prompt_tokens=tally.prompt_tokens,
        cached_tokens=tally.cached_tokens,
        completion_tokens=tally.completion_tokens,
        ttft_s=None if clock.first_token is None else clock.first_token - clock.start,
        latency_s=now - clock.start,
        finish_reason=",".join(reasons) or None,
        miss_reason=misses[0][1] if misses else None,
    )


def sse_response(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(
        events, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    )


class Framing(Protocol):
    """How one protocol writes a stream: each method gives whole SSE texts. `closing` comes after
    the last piece, `final` is the last event of a stream that ended well (the request counts as
    answered once it is being sent), `failure` ends a stream whose choice or engine failed."""

    def opening(self, first: Piece | None) -> Iterable[str]: ...

    def piece(self, piece: Piece) -> Iterable[str]: ...

    def closing(self, tally: Tally) -> Iterable[str]: ...

    def final(self, tally: Tally) -> str: ...

    def failure(self, err: APIError) -> Iterable[str]: ...


async def event_stream(
    ctx: ServingContext,
    endpoint: str,
    pieces: AsyncIterator[Piece],
    first: Piece | None,
    *,
    tally: Tally,
    clock: Clock,
    framing: Framing,
) -> AsyncIterator[str]:
    """The events of one request (its first piece already taken, see `generation.first_piece`)."""
    status = CLIENT_CLOSED
    try:
        for text in framing.opening(first):
            yield text
        piece = first
        while piece is not None:
            clock.saw(piece)
            tally.add(piece)
            if piece.error is not None:
                err = failed_choice(ctx.client, piece.error)
                status = err.status
                for text in framing.failure(err):
                    yield text
                return
            for text in framing.piece(piece):
                yield text
            try:
                piece = await anext(pieces)
            except StopAsyncIteration:
                piece = None
        for text in framing.closing(tally):
            yield text
        last = framing.final(tally)
        status = 200
        yield last
    except FreeTokenError as exc:
        err = engine_error(ctx.client, exc)
        status = err.status
        for text in framing.failure(err):
            yield text
    except asyncio.CancelledError:
        status = CLIENT_CLOSED
        raise
    finally:
        await _close(pieces)
        record(ctx, endpoint, status, tally, clock)


@dataclass
class DataFraming:
    """OpenAI's `data: {...}` stream: the `preamble` objects, each piece's `chunks`, the
    `usage_chunk` when asked for, then `data: [DONE]`; a failure is one `data: {"error": ...}`."""

    preamble: list[dict[str, Any]]
    chunks: Callable[[Piece], list[dict[str, Any]]]
    usage_chunk: Callable[[Tally], dict[str, Any]] | None

    def opening(self, first: Piece | None) -> list[str]:
        return [sse(obj) for obj in self.preamble]

    def piece(self, piece: Piece) -> list[str]:
        return [sse(obj) for obj in self.chunks(piece)]

    def closing(self, tally: Tally) -> list[str]:
        return [] if self.usage_chunk is None else [sse(self.usage_chunk(tally))]

    def final(self, tally: Tally) -> str:
        return DONE_EVENT

    def failure(self, err: APIError) -> list[str]:
        return [sse(err.body())]
