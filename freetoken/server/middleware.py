"""Pure ASGI middlewares for the checks and headers every response goes through.

Owns the API-key gate and fixed response headers as plain ASGI wrappers. Starlette's
`@app.middleware("http")` (BaseHTTPMiddleware) would relay every chunk of a streamed response
through an extra memory stream and task switch; a token stream sends one chunk per token, so that
cost lands on every token. These wrappers only look at the scope or the response start message.
"""

from __future__ import annotations

from collections.abc import Callable

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send


class Gate:
    """Runs `check(request)` before the app: a Response it returns is sent instead (e.g. a 401)."""

    def __init__(self, app: ASGIApp, check: Callable[[Request], Response | None]) -> None:
        self.app = app
        self.check = check

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            refusal = self.check(Request(scope))
            if refusal is not None:
                await refusal(scope, receive, send)
                return
        await self.app(scope, receive, send)


class ResponseHeader:
    """Adds one fixed header to every HTTP response."""

    def __init__(self, app: ASGIApp, name: str, value: str) -> None:
        self.app = app
        self.header = (name.lower().encode("latin-1"), value.encode("latin-1"))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_header(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), self.header]}
            await send(message)

        await self.app(scope, receive, send_with_header)
