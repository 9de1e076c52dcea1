"""One request's choices as the routes see them: engine updates turned into text pieces.

Owns `run_choice` (one engine generation: incremental detokenization, stop strings -- on a match
it tells the engine to finish the request --, and aborting the request when the consumer goes
away), `merge` (the `n` choices of a request interleaved as they come), the collection of a
finished request for non-streaming responses, and the SSE framing. It builds no response bodies
(the route modules do) and never imports torch.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio

from freetoken.errors import FreeTokenError
from freetoken.request import CacheReport, SamplingParams
from freetoken.server.errors import APIError, bad_request
from freetoken.tokenizer import IncrementalDetokenizer, Tokenizer

if TYPE_CHECKING:
    from freetoken.server.process.client import EngineClient

DONE_EVENT = "data: [DONE]\n\n"
_CONTEXT_IDS = 8  # prompt ids that seed the detokenizer, so the first token decodes as after the prompt


@dataclass(frozen=True)
class ChoiceSpec:
    index: int
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    eos_ids: frozenset[int]
    boundaries: tuple[int, ...] = ()
    include_stop: bool = False  # `no_stop_trim`: a matched stop string stays at the end of the text
    pins: tuple[tuple[int, float], ...] = ()  # retention pins (core/pins.py): (position, TTL s)


@dataclass
class Piece:
    """What one engine update of one choice became."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Any] = field(default_factory=list)  # per token: None or [id, logprob, [[id, lp], ...]]
    finish_reason: str | None = None
    error: str | None = None
    report: CacheReport = CacheReport()  # the engine's, as of this update
    prompt_logprobs: list[Any] | None = None
    stop_string: str | None = None  # the stop string that ended the choice (finish_reason "stop")


@dataclass
class ChoiceResult:
    """A choice collected whole (non-streaming responses and usage)."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Any] = field(default_factory=list)
    finish_reason: str | None = None
    report: CacheReport = CacheReport()  # brought up to each piece's (CacheReport.after)
    prompt_logprobs: list[Any] | None = None
    stop_string: str | None = None
    pieces: list[Piece] = field(default_factory=list)  # as they came, for a route that parses piece by piece

    def add(self, piece: Piece) -> None:
        self.pieces.append(piece)
        self.text += piece.text
        self.token_ids += piece.token_ids
        self.logprobs += piece.logprobs
        self.report = self.report.after(piece.report)
        if piece.prompt_logprobs is not None:
            self.prompt_logprobs = piece.prompt_logprobs
        if piece.finish_reason is not None:
            self.finish_reason = piece.finish_reason
            self.stop_string = piece.stop_string


async def _close(stream: AsyncIterator[Any]) -> None:
    """Close an iterator even from a cancelled task (a client that went away): closing the
    engine client's iterator aborts the request, which releases its pages."""
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        with anyio.CancelScope(shield=True):
            await aclose()


async def run_choice(client: EngineClient, spec: ChoiceSpec, tokenizer: Tokenizer) -> AsyncIterator[Piece]:
    """Pieces of one choice until it finishes. Raises EngineUnavailable / EngineRefused from the
    client before the first piece."""
    params = spec.params
    detok = IncrementalDetokenizer(
        tokenizer,
        skip_special_tokens=params.skip_special_tokens,
        stop=params.stop,
        include_stop_string=spec.include_stop,
        context_ids=spec.prompt_ids[-_CONTEXT_IDS:],
        hidden_ids=() if params.ignore_eos else spec.eos_ids,  # the token that ends the output is no text
    )
    stream = client.generate(
        spec.rid, spec.prompt_ids, params, eos_ids=spec.eos_ids, boundaries=spec.boundaries, pins=spec.pins
    )
    finished = False
    try:
        async for upd in stream:
            piece = Piece(spec.index, report=upd.report, prompt_logprobs=upd.prompt_logprobs)
            if not detok.stopped:
                piece.text = detok.add_many(upd.token_ids).text
                piece.token_ids = list(upd.token_ids)
                piece.logprobs = list(upd.logprobs)
                if detok.stopped:
                    await client.finish(spec.rid)  # the engine's final update follows
            if upd.finished:
                finished = True
                if upd.error is not None or upd.finish_reason == "error":
                    piece.error = upd.error or "the engine could not finish this request"
                    piece.finish_reason = "error"
                elif detok.stopped:
                    piece.finish_reason = "stop"
                    piece.stop_string = detok.stop_string
                else:
                    piece.text += detok.finish().text
                    piece.finish_reason = upd.finish_reason or "stop"
            if piece.text or piece.token_ids or piece.finish_reason or piece.prompt_logprobs is not None:
                yield piece
            if finished:
                return
    finally:
        if not finished:
            await _close(stream)


async def merge(streams: Sequence[AsyncIterator[Piece]]) -> AsyncIterator[Piece]:
    """The pieces of several choices, interleaved as they arrive. An exception of one choice is
    re-raised here; closing this iterator closes (aborts) every choice."""
    if len(streams) == 1:
        try:
            async for piece in streams[0]:
                yield piece
        finally:
            await _close(streams[0])
        return
    queue: asyncio.Queue[Piece | Exception | None] = asyncio.Queue()

    async def pump(stream: AsyncIterator[Piece]) -> None:
        try:
            async for piece in stream:
                queue.put_nowait(piece)
        except Exception as err:  # noqa: BLE001 - handed to the consumer, which re-raises it
            queue.put_nowait(err)
        finally:
            queue.put_nowait(None)

    tasks = [asyncio.create_task(pump(s)) for s in streams]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        with anyio.CancelScope(shield=True):
            await asyncio.gather(*tasks, return_exceptions=True)


def engine_error(client: EngineClient, err: FreeTokenError) -> APIError:
    """EngineRefused -> 400 with its code and param (429 for a full queue); EngineUnavailable (and other engine errors) -> 503."""
    code = getattr(err, "code", None)
    if code == "queue_full":
        return APIError(
            429, str(getattr(err, "message", err)), code="rate_limit_exceeded", headers={"Retry-After": "1"}
        )
    if code is not None:  # EngineRefused carries .message .code .param
        return bad_request(str(getattr(err, "message", err)), param=getattr(err, "param", None), code=code)
    return APIError(503, f"engine unavailable: {err}", code="engine_unavailable", headers={"Retry-After": "5"})


def failed_choice(client: EngineClient, message: str) -> APIError:
    """A choice that ended with an engine error, for a response not yet started."""
    if client.state != "ready":
        return APIError(503, f"engine unavailable: {message}", code="engine_unavailable", headers={"Retry-After": "5"})
    return APIError(500, message, code="engine_error")


@dataclass
class Clock:
    """When a request started and when its first token came (for the TTFT/latency metrics)."""

    start: float = field(default_factory=time.perf_counter)
    first_token: float | None = None

    def saw(self, piece: Piece) -> None:
        if self.first_token is None and piece.token_ids:
            self.first_token = time.perf_counter()


async def collect(client: EngineClient, pieces: AsyncIterator[Piece], num: int, clock: Clock) -> list[ChoiceResult]:
    """Every choice whole; an engine error in any choice becomes the APIError of the response."""
    results = [ChoiceResult() for _ in range(num)]
    try:
        async for piece in pieces:
            clock.saw(piece)
            if piece.error is not None:
                raise failed_choice(client, piece.error)
            results[piece.index].add(piece)
    except FreeTokenError as err:
        raise engine_error(client, err) from None
    finally:
        await _close(pieces)
    return results


async def first_piece(client: EngineClient, pieces: AsyncIterator[Piece]) -> Piece | None:
    """The first piece, before a stream's headers go out, so that a refusal is still an HTTP error."""
    try:
        return await anext(pieces)
    except StopAsyncIteration:
        return None
    except FreeTokenError as err:
        await _close(pieces)
        raise engine_error(client, err) from None


def sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"
