"""Per-request hygiene for agents: the `x-request-id` of every response and `--request-timeout`.

Owns `RequestIdMiddleware` (a pure ASGI middleware: it takes the client's `x-request-id` when it
is a sane token, else generates one, keeps it in the request's scope state, and echoes it as
`x-request-id` and `request-id` on every response it sends), `engine_rid` (the id a choice is
known by in the engine, which contains the request id so engine logs can be matched), and
`Deadline` (a request running past `--request-timeout` is cancelled: before its response started
it becomes a 504, a stream that already started gets one error event; either way the request's
iterators are closed, which aborts it in the engine and releases its pages). It builds no
response bodies of its own beyond the timeout error and knows nothing of the engine.
Also `cancel_on_disconnect`: a route's work (a non-streaming generation, or a stream before its
headers) is cancelled the moment its client disconnects, which closes the request's iterators
and so aborts it in the engine within one step.
"""

from __future__ import annotations

import asyncio
import re
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import anyio
from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from freetoken.server.errors import APIError

REQUEST_ID_HEADER = "x-request-id"
CLIENT_CLOSED = 499  # nginx's status for "the client closed the connection": logged and counted, never sent
_SANE_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")
_STATE_KEY = "request_id"


def new_request_id() -> str:
    return f"req-{uuid.uuid4().hex}"


def sane_request_id(given: str | None) -> str | None:
    """The client's id if it is 1-128 characters of [A-Za-z0-9._:-] (it ends up in logs and
    headers), else None."""
    if given is None or _SANE_ID.fullmatch(given) is None:
        return None
    return given


class RequestIdMiddleware:
    """Every HTTP response carries `x-request-id` (and `request-id`, which the anthropic client
    reads): the client's own when sane, else a generated one."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = None
        for name, value in scope.get("headers", ()):
            if name == REQUEST_ID_HEADER.encode():
                given = value.decode("latin-1")
                break
        request_id = sane_request_id(given) or new_request_id()
        scope.setdefault("state", {})[_STATE_KEY] = request_id
        raw = request_id.encode()

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", ()) if k not in (b"x-request-id", b"request-id")]
                message = {**message, "headers": [*headers, (b"x-request-id", raw), (b"request-id", raw)]}
            await send(message)

        await self.app(scope, receive, send_with_id)


def request_id_of(request: Request) -> str:
    """The id the middleware gave this request (a fresh one if the middleware is not installed)."""
    state = request.scope.get("state") or {}
    value = state.get(_STATE_KEY)
    return value if isinstance(value, str) else new_request_id()


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone away (the body was read already: only `http.disconnect`
    can come; uvicorn also sends it once the response is complete, when nobody waits any more)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def cancel_on_disconnect(request: Request, work: Awaitable[Response]) -> Response:
    """Await `work` (after the body was read); if the client disconnects first, cancel it --
    its `finally` blocks abort the engine request -- and answer CLIENT_CLOSED."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:  # also when this coroutine itself is cancelled (--request-timeout)
        watcher.cancel()
        if not task.done():
            task.cancel()
        with anyio.CancelScope(shield=True):
            await asyncio.gather(task, watcher, return_exceptions=True)
    if task.cancelled():
        return Response(status_code=CLIENT_CLOSED)
    return task.result()


def engine_rid(request_id: str, response_id: str, index: int) -> str:
    """The engine's id for choice `index`: unique even when a client reuses its x-request-id."""
    return f"{request_id}/{response_id}-{index}"


def timeout_error(seconds: float) -> APIError:
    return APIError(
        504,
        f"the request ran past the server's request timeout ({seconds:g} s, --request-timeout) and was ended",
        type="timeout_error",
        code="request_timeout",
    )


@dataclass(frozen=True)
class Deadline:
    """`--request-timeout` for one request; `seconds` None = no limit."""

    seconds: float | None
    at: float | None  # the event loop's clock

    @classmethod
    def after(cls, seconds: float | None) -> Deadline:
        return cls(seconds, None if seconds is None else asyncio.get_running_loop().time() + seconds)

    async def run(self, work: Awaitable[Response]) -> Response:
        """Await a route's work; past the deadline it is cancelled (closing its iterators aborts
        the engine request) and a 504 is raised."""
        if self.at is None or self.seconds is None:
            return await work
        cm = asyncio.timeout_at(self.at)
        try:
            async with cm:
                return await work
        except TimeoutError:
            if cm.expired():
                raise timeout_error(self.seconds) from None
            raise

    def bound_stream(self, response: Response, error_event: Callable[[APIError], str]) -> Response:
        """A streaming response whose body ends with `error_event(504)` at the deadline."""
        if self.at is None or self.seconds is None or not isinstance(response, StreamingResponse):
            return response
        response.body_iterator = self._events(response.body_iterator, error_event)
        return response

    async def _events(
        self, events: AsyncIterator[str | bytes], error_event: Callable[[APIError], str]
    ) -> AsyncIterator[str | bytes]:
        if self.at is None or self.seconds is None:
            raise RuntimeError("_events needs a deadline")
        try:
            while True:
                cm = asyncio.timeout_at(self.at)
                try:
                    async with cm:
                        event = await anext(events)
                except StopAsyncIteration:
                    return
                except TimeoutError:
                    if not cm.expired():
                        raise
                    yield error_event(timeout_error(self.seconds))
                    return
                yield event
        finally:
            aclose = getattr(events, "aclose", None)
            if aclose is not None:
                with anyio.CancelScope(shield=True):
                    await aclose()
