"""The FastAPI app of `ft serve`: the middleware every request goes through, and the routers.

Owns what comes before any route: the API-key gate (every path under `KEYED_PREFIXES`, so an
`/admin/...` route added later is covered without code of its own; with `--unprefixed-routes`
every path but `OPEN_PATHS`), the body-size limit (request_body.py), a log line for every request
but those to `QUIET_PATHS` (operations/request_log.py), `x-request-id` on every
response, CORS (`--allowed-origins`), the `x-freetoken-replica` header, and the error dialect of
answers sent before a route runs (401, 404, 405, 413: Anthropic's body under `/v1/messages`, else
the server's own). The routes are the routers' of the protocol packages (`openai`, `responses`,
`anthropic`; this is the one module that imports all three) and of `admin` (health, cache status,
metrics, drain, cache resize, router probes, the dashboard page at `/`, which needs no key);
`--unprefixed-routes` adds the OpenAI routes without `/v1`. The app reaches the engine only through its `EngineClient`; it never imports torch.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager

from fastapi import APIRouter, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import Response
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException

from freetoken import __version__
from freetoken.server.admin.dashboard import DASHBOARD_PATH
from freetoken.server.admin.probes import probe_router
from freetoken.server.admin.routes import admin_router
from freetoken.server.anthropic.errors import ANTHROPIC_DIALECT
from freetoken.server.anthropic.routes import PATH_PREFIX as ANTHROPIC_PREFIX
from freetoken.server.anthropic.routes import anthropic_router
from freetoken.server.context import ServingContext
from freetoken.server.core.endpoint import DEFAULT_DIALECT, Dialect
from freetoken.server.errors import APIError, http_error, install_error_handlers
from freetoken.server.middleware import Gate, ResponseHeader
from freetoken.server.openai.routes import openai_router
from freetoken.server.operations.request_log import RequestLines
from freetoken.server.operations.worker_info import PROBE_PATHS, REPLICA_HEADER, replica_name
from freetoken.server.request_body import BodyLimit
from freetoken.server.request_hygiene import RequestIdMiddleware, request_id_of
from freetoken.server.responses.routes import responses_router

log = logging.getLogger(__name__)

UNPREFIXED_EXCLUDED = ("/v1/messages", "/v1/cache", "/v1/tokenize", "/v1/detokenize")  # not OpenAI routes
OPEN_PATHS = (
    "/health",
    "/metrics",
    DASHBOARD_PATH,
    *PROBE_PATHS,
)  # with --unprefixed-routes, every other path needs the key
KEYED_PREFIXES = ("/v1", "/admin")  # paths that need the API key (when one is set)
# No request line for these: health checks, metrics scrapes, routers' probes and the dashboard (its
# page and what it polls every few seconds) would bury the lines of the API's requests
QUIET_PATHS = ("/health", "/metrics", "/v1/cache/status", "/admin/activity", DASHBOARD_PATH, *PROBE_PATHS)


def dialect_of(path: str) -> Dialect:
    """The error dialect of a path: Anthropic's under `/v1/messages`, else the server's own."""
    return ANTHROPIC_DIALECT if path.startswith(ANTHROPIC_PREFIX) else DEFAULT_DIALECT


def in_dialect(request: Request, err: APIError) -> Response:
    return dialect_of(request.url.path).response(err, request_id_of(request))


def _authorized(request: Request, key: str) -> bool:
    bearer = request.headers.get("authorization", "")
    if bearer[:7].lower() == "bearer " and hmac.compare_digest(bearer[7:].strip().encode(), key.encode()):
        return True
    given = request.headers.get("x-api-key")
    return given is not None and hmac.compare_digest(given.encode(), key.encode())


def api_key_check(ctx: ServingContext) -> Callable[[Request], Response | None]:
    """The gate's check: a 401 in the path's dialect when a keyed path comes without the key."""

    def check(request: Request) -> Response | None:
        key = ctx.config.api_key
        path = request.url.path
        keyed = path.startswith(KEYED_PREFIXES) or (ctx.config.unprefixed_routes and path not in OPEN_PATHS)
        if key is not None and keyed and not _authorized(request, key):
            message = "a valid API key is required: send 'Authorization: Bearer KEY' or 'x-api-key: KEY'"
            return in_dialect(request, APIError(401, message, code="invalid_api_key"))
        return None

    return check


def engine_lifespan(ctx: ServingContext, manage_client: bool) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    """With `manage_client`, the app's lifespan starts the engine client (which launches the engine
    process) and stops it at shutdown."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if manage_client:
            await ctx.client.start()
        try:
            yield
        finally:
            if manage_client:
                await ctx.client.stop()

    return lifespan


def add_middleware(app: FastAPI, ctx: ServingContext) -> None:
    """Innermost first: the body limit inside the key check (only an authorized client learns the
    limit; a 413 is sent before the body is read), then the gate, the request lines (so a 401 or
    413 is logged too), request ids (which the lines name), CORS (preflights answered before the
    key check) and, outermost, the replica header."""
    app.add_middleware(BodyLimit, max_bytes=ctx.config.max_request_bytes, render=in_dialect)
    app.add_middleware(Gate, check=api_key_check(ctx))  # pure ASGI: streamed chunks pass untouched
    app.add_middleware(RequestLines, quiet=QUIET_PATHS)  # one log line per request
    app.add_middleware(RequestIdMiddleware)  # every response carries x-request-id
    if ctx.config.allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(ctx.config.allowed_origins),
            allow_methods=["*"],
            allow_headers=["*"],
            expose_headers=["x-request-id"],
        )
    app.add_middleware(ResponseHeader, name=REPLICA_HEADER, value=replica_name(ctx))


def add_unprefixed_routes(app: FastAPI, routers: Sequence[APIRouter]) -> None:
    """`--unprefixed-routes`: every OpenAI route under `/v1/` also answers without it."""
    for route in [r for router in routers for r in router.routes]:
        if (
            isinstance(route, APIRoute)
            and route.path.startswith("/v1/")
            and not route.path.startswith(UNPREFIXED_EXCLUDED)
        ):
            app.add_api_route(
                route.path.removeprefix("/v1"), route.endpoint, methods=list(route.methods), include_in_schema=False
            )


def build_app(ctx: ServingContext, *, manage_client: bool = True) -> FastAPI:
    """The app over a serving context (see `engine_lifespan` for `manage_client`)."""
    app = FastAPI(
        title="FreeToken",
        version=__version__,
        lifespan=engine_lifespan(ctx, manage_client),
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    install_error_handlers(app)

    async def on_http(request: Request, exc: Exception) -> Response:  # unknown paths and methods, in the path's dialect
        return in_dialect(request, http_error(request, exc))

    app.add_exception_handler(StarletteHTTPException, on_http)
    add_middleware(app, ctx)
    routers = (openai_router(ctx), responses_router(ctx), anthropic_router(ctx), admin_router(ctx), probe_router(ctx))
    for router in routers:
        app.include_router(router)
    if ctx.config.unprefixed_routes:
        add_unprefixed_routes(app, routers)
    app.state.serving = ctx
    return app
