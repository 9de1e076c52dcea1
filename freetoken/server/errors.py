"""HTTP errors in the OpenAI wire format, and the handlers that make every failure one.

Owns `APIError` (a status plus the `{"error": {message, type, param, code}}` body of DESIGN.md §4),
the conversion of pydantic validation errors into a 400 `invalid_request_error` that names the
offending field (never FastAPI's 422), and the exception handlers installed on the app. It knows
nothing of the engine or the routes and imports nothing of the server: it is plumbing, so the
middlewares, the context and the drain raise it as the core and the protocols do.
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


def _body_path(loc: Sequence[int | str], body: Any, missing: bool) -> tuple[int | str, ...]:
    """The location of an error inside the request body: pydantic's union branch labels (a type
    name such as `list[TextPart]`, or the tag of a tagged union, which equals the object's
    `type`) are dropped by walking the body along the location; only a `missing` error ends in a
    key the body does not have."""
    path: list[int | str] = []
    node = body
    for k, part in enumerate(loc):
        last = k == len(loc) - 1
        if isinstance(node, dict) and not last and node.get("type") == part:
            continue  # a tagged-union label
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            node = node[part]
        elif not (last and missing and isinstance(node, dict)):
            continue  # a union branch label
        path.append(part)
    return tuple(path)


def from_validation_errors(errors: Sequence[Any], body: Any = None) -> APIError:
    """The first pydantic error as a 400 that names its field. A union field that matched no
    branch yields one error per branch: given the request `body`, the branch that got deepest into
    it names the field; otherwise they are named by the longest location they share."""
    if not errors:
        return bad_request("invalid request")
    locs = [tuple(p for p in e.get("loc", ()) if p != "body") for e in errors]
    if body is not None:
        locs = [_body_path(loc, body, e.get("type") == "missing") for loc, e in zip(locs, errors)]
    group = [(loc, e) for loc, e in zip(locs, errors) if loc[:1] == locs[0][:1]]
    if body is not None and len(group) > 1:
        deepest = max(len(loc) for loc, _ in group)
        deep = [(loc, e) for loc, e in group if len(loc) == deepest]
        if len({loc for loc, _ in deep}) == 1 and deepest > min(len(loc) for loc, _ in group):
            group = deep[:1]
    first = group[0][1]
    shared = group[0][0]
    for loc, _ in group[1:]:
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


def from_pydantic(err: ValidationError, body: Any = None) -> APIError:
    return from_validation_errors(err.errors(include_url=False), body)


def http_error(request: Request, exc: Exception) -> APIError:
    """A routing failure as an APIError: an unknown path or method says that the route does not exist."""
    status = getattr(exc, "status_code", 500)
    detail = getattr(exc, "detail", None)
    route = f"{request.method} {request.url.path}"
    if status == 404 and detail == "Not Found":
        return APIError(404, f"Invalid URL ({route}): this route does not exist", code="not_found")
    if status == 405:
        return APIError(
            405, f"Invalid method ({route}): this route does not take {request.method}", code="method_not_allowed"
        )
    message = detail if isinstance(detail, str) else "error"
    return APIError(status, message, headers=getattr(exc, "headers", None))


def install_error_handlers(app: FastAPI) -> None:
    """Every failure leaves the app as an OpenAI error body."""

    async def on_api_error(_: Request, exc: Exception) -> JSONResponse:
        if not isinstance(exc, APIError):  # registered for APIError only
            raise exc
        return exc.response()

    async def on_validation(_: Request, exc: Exception) -> JSONResponse:
        errors = exc.errors() if isinstance(exc, RequestValidationError) else []
        return from_validation_errors(errors).response()

    async def on_http(request: Request, exc: Exception) -> JSONResponse:
        return http_error(request, exc).response()

    async def on_unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error in a request", exc_info=exc)
        return APIError(500, f"internal server error: {type(exc).__name__}: {exc}").response()

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(Exception, on_unexpected)
