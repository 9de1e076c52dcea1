"""Errors in Anthropic's wire format, for the `/v1/messages` routes only.

Owns the mapping from an `APIError` (the server's one error type, OpenAI-shaped) to Anthropic's
body `{"type": "error", "error": {"type", "message"}, "request_id"}` with the same status and
headers, the SSE `event: error` of a stream that fails after it started, the SSE framing of
Anthropic's named events, and `ANTHROPIC_DIALECT`, which hands all three to the core's
`run_endpoint` (Anthropic's routes answer unexpected failures in their own body too). The OpenAI
routes keep their own bodies; this module is never used there.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi.responses import JSONResponse

from freetoken.server.core.endpoint import Dialect
from freetoken.server.errors import APIError

# Anthropic's documented error types by status (503 and 504 keep their status: the anthropic
# client maps them to ServiceUnavailableError and GatewayTimeoutError).
_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}


def anthropic_error_type(status: int) -> str:
    return _TYPE_BY_STATUS.get(status, "api_error" if status >= 500 else "invalid_request_error")


def anthropic_error_body(err: APIError, request_id: str | None) -> dict[str, Any]:
    """Anthropic's error body; the message names the offending field when the error has one."""
    message = err.message
    if err.param and err.param not in message:
        message = f"{err.param}: {message}"
    body: dict[str, Any] = {"type": "error", "error": {"type": anthropic_error_type(err.status), "message": message}}
    if request_id is not None:
        body["request_id"] = request_id
    return body


def anthropic_error_response(err: APIError, request_id: str | None) -> JSONResponse:
    return JSONResponse(anthropic_error_body(err, request_id), status_code=err.status, headers=err.headers)


def event(name: str, data: dict[str, Any]) -> str:
    """One named server-sent event."""
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


def error_event(err: APIError, request_id: str | None) -> str:
    """The `event: error` that ends a stream failing after it started."""
    return event("error", anthropic_error_body(err, request_id))


ANTHROPIC_DIALECT = Dialect(anthropic_error_response, error_event, answers_unexpected=True)
