"""One generation endpoint's life over HTTP, the same for every wire protocol.

Owns `Dialect` (how a protocol answers a failure: its error body, the event that ends a stream
that fails after it started, and whether it answers an unexpected exception itself or leaves it
to the app's handler), `DEFAULT_DIALECT` (the server's own OpenAI-shaped body, which the OpenAI
and Responses routes use) and `run_endpoint`: the drain gate (503 while shutting down), the body
parsed into the route's model off the event loop (request_body.py; the model's own checks run
there), the model name checked (404 `model_not_found`), the route's handler run
under `--request-timeout` and cancelled when its client disconnects, a failure counted in the
metrics, logged (the request's one line) and answered in the route's dialect, and a started stream bounded by the deadline.

It builds no bodies of its own and knows no protocol's shapes: a protocol's router passes its
request model, its handler and its dialect.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar, cast

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel

from freetoken.errors import FreeTokenError
from freetoken.server.context import ServingContext
from freetoken.server.errors import APIError
from freetoken.server.operations.request_log import log_refused, request_line
from freetoken.server.core.generation import sse
from freetoken.server.request_body import parse_body
from freetoken.server.request_hygiene import CLIENT_CLOSED, Deadline, cancel_on_disconnect, request_id_of

log = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)


class NamesModel(Protocol):
    """Every generation request names the model it asks for."""

    @property
    def model(self) -> str: ...


Handler = Callable[[ServingContext, M, str], Awaitable[Response]]  # (context, parsed body, request id)


@dataclass(frozen=True)
class Dialect:
    """How a protocol's routes answer a failure: `response(err, request_id)` before the response
    started, `stream_error(err, request_id)` the event that ends a stream after it started;
    `answers_unexpected`: an exception that is no APIError becomes this dialect's 500 here (else it
    goes on to the app's handler)."""

    response: Callable[[APIError, str], Response]
    stream_error: Callable[[APIError, str], str]
    answers_unexpected: bool = False


DEFAULT_DIALECT = Dialect(lambda err, _: err.response(), lambda err, _: sse(err.body()))


async def run_endpoint(
    ctx: ServingContext,
    endpoint: str,
    request: Request,
    model: type[M],
    handler: Handler[M],
    dialect: Dialect = DEFAULT_DIALECT,
) -> Response:
    """Parse, run under --request-timeout, and answer failures in the route's dialect. The
    request's log line is written here (a failure) or by the generation as it ends (core/streaming.py's
    `record`); a handler that generates nothing writes its own (operations/request_log.py)."""
    request_id = request_id_of(request)
    line = request_line(request.scope)
    line.route, line.written = endpoint, True
    deadline = Deadline.after(ctx.config.request_timeout_s)
    try:
        with ctx.drain.admitted():
            body = await parse_body(request, model)
            ctx.check_model(cast(NamesModel, body).model)
            response = await deadline.run(cancel_on_disconnect(request, handler(ctx, body, request_id)))
    except APIError as err:
        ctx.metrics.record_request(endpoint, err.status)
        log_refused(endpoint, err.status, request_id, err.message)
        return dialect.response(err, request_id)
    except FreeTokenError as exc:  # e.g. the engine went away between the checks and the call
        ctx.metrics.record_request(endpoint, 503)
        err = APIError(503, f"engine unavailable: {exc}", code="engine_unavailable")
        log_refused(endpoint, 503, request_id, err.message)
        return dialect.response(err, request_id)
    except Exception as exc:
        if not dialect.answers_unexpected:
            line.written = False  # the app's handler answers it; the middleware writes the line
            raise
        log.exception("unhandled error in %s request %s", endpoint, request_id)
        ctx.metrics.record_request(endpoint, 500)
        err = APIError(500, f"internal server error: {type(exc).__name__}: {exc}")
        log_refused(endpoint, 500, request_id, err.message)
        return dialect.response(err, request_id)
    if response.status_code == CLIENT_CLOSED:
        ctx.metrics.record_request(endpoint, CLIENT_CLOSED)
        log_refused(endpoint, CLIENT_CLOSED, request_id, "the client disconnected; the request was aborted")
    return deadline.bound_stream(response, lambda err: dialect.stream_error(err, request_id))
