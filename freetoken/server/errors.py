"""HTTP errors in the OpenAI wire format, and the handlers that make every failure one.

Owns `APIError` (a status plus the `{"error": {message, type, param, code}}` body of DESIGN.md §4),
the conversion of pydantic validation errors into a 400 `invalid_request_error` that names the
offending field (never FastAPI's 422), and the exception handlers installed on the app. It knows
nothing of the engine or the routes.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """An HTTP error with an OpenAI error body. Raised by routes, rendered by the handler."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str | None = None,  # noqa: A002 - the wire name
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or _TYPE_BY_STATUS.get(status, "server_error" if status >= 500 else "invalid_request_error")
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:  # noqa: A002
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def _param_path(loc: Sequence[int | str]) -> str | None:
    """`("body", "messages", 0, "role")` -> `messages[0].role`."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out or None


def from_validation_errors(errors: Sequence[Any]) -> APIError:
    """The first pydantic error as a 400 that names its field. A union field that matched no
    branch yields one error per branch (their locations carry the branch labels); they are named
    by the longest location they share."""
    if not errors:
        return bad_request("invalid request")
    locs = [tuple(p for p in e.get("loc", ()) if p != "body") for e in errors]
    first = errors[0]
    group = [loc for loc in locs if loc[:1] == locs[0][:1]]
    shared = locs[0]
    for loc in group[1:]:
        n = 0
        while n < min(len(shared), len(loc)) and shared[n] == loc[n]:
            n += 1
        shared = shared[:n]
    param = _param_path(shared)
    kind = first.get("type", "")
    if kind == "extra_forbidden":
        return bad_request(f"Unrecognized request argument supplied: {param}", param=param, code="unknown_parameter")
    if kind == "missing" and len(group) == 1:
        return bad_request(f"'{param}' is a required property", param=param, code="missing_required_parameter")
    if len(group) > 1:
        return bad_request(f"{param}: invalid type or value", param=param, code="invalid_type")
    message = str(first.get("msg", "invalid value"))
    return bad_request(f"{param}: {message}" if param else message, param=param, code="invalid_value")


def from_pydantic(err: ValidationError) -> APIError:
    return from_validation_errors(err.errors(include_url=False))


def install_error_handlers(app: FastAPI) -> None:
    """Every failure leaves the app as an OpenAI error body."""

    async def on_api_error(_: Request, exc: Exception) -> JSONResponse:
        if not isinstance(exc, APIError):  # registered for APIError only
            raise exc
        return exc.response()

    async def on_validation(_: Request, exc: Exception) -> JSONResponse:
        errors = exc.errors() if isinstance(exc, RequestValidationError) else []
        return from_validation_errors(errors).response()

    async def on_http(_: Request, exc: Exception) -> JSONResponse:
        status = getattr(exc, "status_code", 500)
        detail = getattr(exc, "detail", None)
        message = detail if isinstance(detail, str) else "error"
        return APIError(status, message, headers=getattr(exc, "headers", None)).response()

    async def on_unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error in a request", exc_info=exc)
        return APIError(500, f"internal server error: {type(exc).__name__}: {exc}").response()

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(Exception, on_unexpected)
