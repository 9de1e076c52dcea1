"""One log line per request, when it ends.

Owns the line's content and wording, and `RequestLines`, the middleware that makes it one line
for every request. A generation request's line (route, HTTP status, request id, prompt / cached /
generated tokens, time to the first token, decode speed -- generated tokens after the first over
the time since it came -- and the finish reason(s)) is written by the generation recipe:
core/streaming.py's `record`, which every generation passes through as it ends, and
core/endpoint.py for a refusal (the route, status, id and the error's message). Every other
request gets a short line from the middleware when its response ends: the route's name (or the
method and the route's path), the status, the id, the prompt tokens a counting route counted
(tokenize, count_tokens) and, for an error, its message read from the error body. A route says
what its line holds through `request_line(scope)`: its name, its count, or that it writes the
line itself. Paths that machines poll (health checks, metrics scrapes, the dashboard's own
requests) are left out: the app names them. `--log-format json` gets the same numbers as fields
(`extra`). The logger is `freetoken.requests` (a log filter can silence it).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from freetoken.server.request_hygiene import request_id_of

log = logging.getLogger("freetoken.requests")

STATE_KEY = "request_line"  # the request's RequestLine, in the ASGI scope's state
MAX_ERROR_BODY = 8192  # bytes of an error body read for its message
MAX_PATH = 200  # characters of an unrouted path in a line


@dataclass(frozen=True)
class RequestEnd:
    route: str  # the metrics' endpoint name: chat, completions, responses, messages
    status: int
    request_id: str
    prompt_tokens: int
    cached_tokens: int
    generated_tokens: int
    ttft_s: float | None  # None: no token came
    decode_s: float | None  # from the first token to the end
    finish_reasons: Sequence[str | None]  # per choice (None: the choice did not finish)
    error: str | None = None  # refused before it ran (4xx, 503): the error's message

    @property
    def tokens_per_s(self) -> float | None:
        """Decode speed: the tokens after the first, over the time since the first came."""
        if self.decode_s is None or self.decode_s <= 0 or self.generated_tokens < 2:
            return None
        return (self.generated_tokens - 1) / self.decode_s

    @property
    def finish(self) -> str:
        reasons = [r or "none" for r in self.finish_reasons]
        if not reasons:
            return "none"
        return reasons[0] if len(set(reasons)) == 1 else ",".join(reasons)

    def line(self) -> str:
        ttft = "-" if self.ttft_s is None else f"{self.ttft_s:.3f}s"
        speed = "-" if self.tokens_per_s is None else f"{self.tokens_per_s:.1f}"
        if self.error is not None:
            return f"{self.route} {self.status} id={self.request_id} error={self.error!r}"
        return (
            f"{self.route} {self.status} id={self.request_id} prompt={self.prompt_tokens} cached={self.cached_tokens} "
            f"generated={self.generated_tokens} ttft={ttft} tok/s={speed} finish={self.finish}"
        )

    def fields(self) -> dict[str, object]:
        return {
            "event": "request",
            "route": self.route,
            "status": self.status,
            "request_id": self.request_id,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "generated_tokens": self.generated_tokens,
            "ttft_s": None if self.ttft_s is None else round(self.ttft_s, 4),
            "tokens_per_s": None if self.tokens_per_s is None else round(self.tokens_per_s, 2),
            "finish_reason": self.finish,
            **({} if self.error is None else {"error": self.error}),
        }


def log_request(end: RequestEnd) -> None:
    log.info(end.line(), extra=end.fields())


def log_refused(route: str, status: int, request_id: str, message: str) -> None:
    """A request answered with an error before it ran (its one line)."""
    log_request(RequestEnd(route, status, request_id, 0, 0, 0, None, None, (), message))


def log_plain(
    route: str, status: int, request_id: str, prompt_tokens: int | None = None, error: str | None = None
) -> None:
    """The line of a request that generates nothing: `tokenize 200 id=r prompt=12`,
    `GET /v1/models 200 id=r`, `POST /v1/nope 404 id=r error="..."`."""
    text = f"{route} {status} id={request_id}"
    fields: dict[str, object] = {"event": "request", "route": route, "status": status, "request_id": request_id}
    if prompt_tokens is not None:
        text += f" prompt={prompt_tokens}"
        fields["prompt_tokens"] = prompt_tokens
    if error is not None:
        text += f" error={error!r}"
        fields["error"] = error
    log.info(text, extra=fields)


@dataclass
class RequestLine:
    """What a route leaves for its request's line (`request_line`)."""

    route: str | None = None  # the line's name for the route; None: the method and the route's path
    prompt_tokens: int | None = None  # a route that counts a prompt without running it
    written: bool = False  # the route writes the line itself (the generation recipe)


def request_line(scope: Scope) -> RequestLine:
    """The request's RequestLine (made on first use: a route outside the middleware, as in unit
    tests, still has one to write to)."""
    state = scope.setdefault("state", {})
    line = state.get(STATE_KEY)
    if not isinstance(line, RequestLine):
        line = state[STATE_KEY] = RequestLine()
    return line


def _route_of(scope: Scope) -> str:
    """`METHOD /path`, the path as the route declares it (`/v1/responses/{response_id}`, not
    the id), or as sent when no route matched."""
    path = getattr(scope.get("route"), "path", None) or str(scope.get("path", ""))[:MAX_PATH]
    return f"{scope.get('method', '')} {path}"


def _error_message(body: bytes) -> str | None:
    """The message of an error body: OpenAI's `{"error": {"message"}}` and Anthropic's
    `{"type": "error", "error": {"message"}}` alike."""
    try:
        error = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return None
    message = error.get("message") if isinstance(error, dict) else error
    return message if isinstance(message, str) else None


class RequestLines:
    """ASGI middleware: a line for every HTTP request not under `quiet` whose route wrote none,
    when its response ends (or the app raised: status 500). It only looks at the response's
    start and, for an error, its body; streamed chunks pass untouched."""

    def __init__(self, app: ASGIApp, quiet: Collection[str]) -> None:
        self.app = app
        self.quiet = frozenset(quiet)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") in self.quiet:
            await self.app(scope, receive, send)
            return
        line = request_line(scope)
        status = 500  # until the response starts: an app that raises answers 500
        error = bytearray()

        async def observe(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and status >= 400 and len(error) < MAX_ERROR_BODY:
                error.extend(message.get("body", b"")[: MAX_ERROR_BODY - len(error)])
            await send(message)

        try:
            await self.app(scope, receive, observe)
        finally:
            if not line.written:
                message = _error_message(bytes(error)) if status >= 400 else None
                log_plain(
                    line.route or _route_of(scope), status, request_id_of(Request(scope)), line.prompt_tokens, message
                )
