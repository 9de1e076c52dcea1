"""Request bodies: what a body may cost the API process before any route sees it.

Owns the body-size limit (`BodyLimit`, a pure ASGI middleware: a `Content-Length` above
`--max-request-bytes` is answered 413 before a byte is read; a body without one, chunked, is
counted as it streams in and the read fails with a 413 once it passes the limit) and `parse_body`,
which turns a body into a route's pydantic model off the event loop (a worker thread): a cheap
iterative scan refuses JSON nested deeper than `MAX_JSON_DEPTH` before the recursive decoder runs,
then a lone UTF-16 surrogate (`"\\ud800"`, valid JSON escapes but no text) is a 400 naming its
field. Every refusal is an `APIError`; which dialect renders it is the caller's business (the app
passes `render` for the 413 sent before the route runs). It knows nothing of routes or the engine.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any, TypeVar

import anyio.to_thread
import numpy as np
from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from freetoken.server.errors import APIError, bad_request, from_pydantic

M = TypeVar("M", bound=BaseModel)

# The body limit's default and floor are settings.py's (DEFAULT_MAX_REQUEST_BYTES).
# JSON arrays/objects nested deeper than this are refused before decoding. Real clients nest a few
# levels (OpenAI's structured outputs allow 10 levels of schema, ~25 of JSON); Python's recursive
# decoder and the walkers after it (pydantic, templates, the grammar compiler) fail near 1000.
MAX_JSON_DEPTH = 128

# A whole JSON string literal (escapes included): its brackets are text, not structure.
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
# A \uD800-\uDFFF escape, or a surrogate encoded as UTF-8 bytes (json.loads lets both through).
_MAYBE_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")
_OPEN = np.frombuffer(b"[{", dtype=np.uint8)
_CLOSE = np.frombuffer(b"]}", dtype=np.uint8)


def too_large(limit: int) -> APIError:
    return APIError(
        413,
        f"the request body is larger than the server's limit of {limit} bytes (--max-request-bytes)",
        code="request_too_large",
    )


class BodyTooLarge(APIError):
    """Raised from `receive` when a streamed body passes the limit; routes render it like any APIError."""


class BodyLimit:
    """Refuses bodies above `max_bytes`: by `Content-Length` before reading (sent through
    `render`, which picks the route's error dialect), else by counting the chunks received."""

    def __init__(self, app: ASGIApp, max_bytes: int, render: Callable[[Request, APIError], Response]) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.render = render

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await self.render(Request(scope), too_large(self.max_bytes))(scope, receive, send)
            return
        received = 0

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    err = too_large(self.max_bytes)
                    raise BodyTooLarge(err.status, err.message, code=err.code)
            return message

        await self.app(scope, counted, send)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


def json_depth_exceeds(raw: bytes, limit: int) -> bool:
    """Whether the JSON text `raw` nests arrays/objects deeper than `limit`, brackets inside
    strings not counted. Iterative and vectorised: strings are blanked with one regex pass, then
    the depth is a running sum over the remaining brackets."""
    bare = _STRING.sub(b'""', raw)
    data = np.frombuffer(bare, dtype=np.uint8)
    opens = np.isin(data, _OPEN)
    closes = np.isin(data, _CLOSE)
    marks = np.flatnonzero(opens | closes)
    if len(marks) == 0:
        return limit < 0
    if len(marks) <= limit:  # too few brackets to nest that deep
        return False
    steps = np.where(opens[marks], 1, -1).astype(np.int32)
    return int(np.cumsum(steps).max()) > limit


def _path(parts: tuple[str | int, ...]) -> str | None:
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out or None


def _is_text(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def lone_surrogate_at(obj: Any) -> tuple[str | int, ...] | None:
    """The location of the first string (or key) holding a lone UTF-16 surrogate, found by an
    iterative walk; None when every string is text."""
    stack: list[tuple[Any, tuple[str | int, ...]]] = [(obj, ())]
    while stack:
        node, where = stack.pop()
        if isinstance(node, str):
            if not _is_text(node):
                return where
        elif isinstance(node, dict):
            for key, value in node.items():
                if not _is_text(key):
                    return where
                stack.append((value, (*where, key)))
        elif isinstance(node, list):
            stack.extend((value, (*where, i)) for i, value in enumerate(node))
    return None


def decode_json_object(raw: bytes, max_depth: int = MAX_JSON_DEPTH) -> dict[str, Any]:
    """A request body as a JSON object; a 400 for nesting past `max_depth`, text that is not
    JSON, a value that is not an object, or a lone surrogate (naming its field)."""
    if json_depth_exceeds(raw, max_depth):
        raise bad_request(
            f"the request body nests JSON arrays/objects deeper than the server's limit of {max_depth} levels",
            code="json_too_deep",
        )
    try:
        obj = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as err:
        raise bad_request(f"the request body is not valid JSON ({err})", code="invalid_json") from None
    if not isinstance(obj, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(obj).__name__}", code="invalid_json")
    if _MAYBE_SURROGATE.search(raw) is not None:
        where = lone_surrogate_at(obj)
        if where is not None:
            param = _path(where)
            raise bad_request(
                f"{param or 'the request body'}: a string holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff escape), "
                "which is not text",
                param=param,
                code="invalid_unicode",
            )
    return obj


def _validate(raw: bytes, model: type[M]) -> M:
    obj = decode_json_object(raw)
    try:
        return model.model_validate(obj)
    except ValidationError as err:
        raise from_pydantic(err, obj) from None


async def parse_body(request: Request, model: type[M]) -> M:
    """The request's body as `model`, decoded and validated in a worker thread so that a large
    body never stalls the event loop (and with it `/health` and every other request)."""
    raw = await request.body()
    return await anyio.to_thread.run_sync(_validate, raw, model)
