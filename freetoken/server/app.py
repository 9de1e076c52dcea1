"""The FastAPI app of `ft serve`: routes, API-key check, request parsing.

Owns the HTTP surface of DESIGN.md §4: `/v1/completions`, `/v1/chat/completions`, `/v1/messages`
(+ `/count_tokens`, Anthropic error bodies), `/v1/tokenize`, `/v1/detokenize`, `/v1/models`,
`/v1/responses` (+ `GET`/`DELETE /v1/responses/{id}` and `/input_items`, over the app's response store), `/health`,
`/v1/cache/status`, `/metrics`, `POST /admin/drain` (docs/operations.md), vLLM's render routes
(`/v1/chat/completions/render`, `/v1/completions/render`: openai/render.py) and the router probes
of operations/worker_info.py (`/server_info`, `/model_info`, `/get_load`, ...; docs/scale-out.md). The API
key guards every path under `KEYED_PREFIXES` (an `/admin/...` route added later is covered
without code of its own). Bodies are size-limited and parsed by request_body.py (off the event
loop; malformed JSON, a body that is not an object, nesting past the limit, lone surrogates and
schema errors are 400s naming the field, a body past --max-request-bytes a 413), then handed to the route modules of
the protocol packages (`openai`, `responses`, `anthropic`; this is the one module that imports
all three);
generation passes the drain gate (503 while shutting down), runs under `--request-timeout` and
is cancelled when its client disconnects; every response carries `x-request-id`.
The app reaches the engine only through its `EngineClient`; it never imports torch.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import anyio.to_thread
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException
from pydantic import BaseModel

from freetoken import __version__
from freetoken.errors import FreeTokenError
from freetoken.server.anthropic.errors import anthropic_error_response, error_event
from freetoken.server.anthropic.messages import count_message_tokens, create_message
from freetoken.server.anthropic.protocol import CountTokensRequest, MessagesRequest
from freetoken.server.anthropic.threads import ThreadStore
from freetoken.server.context import DEFAULT_MODEL_ALIAS, ServingContext
from freetoken.server.core.generation import sse
from freetoken.server.errors import APIError, http_error, install_error_handlers
from freetoken.server.middleware import Gate
from freetoken.server.openai.chat import create_chat_completion
from freetoken.server.openai.completions import create_completion
from freetoken.server.openai.protocol import ChatCompletionRequest, CompletionRequest
from freetoken.server.openai.render import render_chat_request, render_completion_request
from freetoken.server.openai.tokenize import DetokenizeRequest, TokenizeRequest, detokenize, tokenize
from freetoken.server.operations.admin_cache import ResizeRequest, resize_cache
from freetoken.server.operations.worker_info import PROBE_PATHS, install_worker_routes
from freetoken.server.request_body import BodyLimit, parse_body
from freetoken.server.request_hygiene import CLIENT_CLOSED, Deadline, RequestIdMiddleware, cancel_on_disconnect, request_id_of
from freetoken.server.responses.protocol import ResponsesRequest
from freetoken.server.responses.routes import create_response, delete_response, get_response, list_input_items
from freetoken.server.responses.store import ResponseStore

log = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)
STATUS_TIMEOUT_S = 10.0
UNPREFIXED_EXCLUDED = ("/v1/messages", "/v1/cache", "/v1/tokenize", "/v1/detokenize")  # not OpenAI routes
OPEN_PATHS = ("/health", "/metrics", *PROBE_PATHS)  # with --unprefixed-routes, every other path needs the key
KEYED_PREFIXES = ("/v1", "/admin")  # paths that need the API key (when one is set)


def _authorized(request: Request, key: str) -> bool:
    bearer = request.headers.get("authorization", "")
    if bearer[:7].lower() == "bearer " and hmac.compare_digest(bearer[7:].strip().encode(), key.encode()):
        return True
    given = request.headers.get("x-api-key")
    return given is not None and hmac.compare_digest(given.encode(), key.encode())


async def engine_status(ctx: ServingContext) -> dict[str, Any]:
    """The `/v1/cache/status` document: the engine's status, with every DESIGN.md §4 field present."""
    doc = dict(await asyncio.wait_for(ctx.client.status(), timeout=STATUS_TIMEOUT_S))
    doc.setdefault("floor", None)  # models without sliding-window layers have no SWA floor
    info = ctx.client.info
    doc.setdefault("model", ctx.served_name)
    doc["engine"] = {
        **(doc.get("engine") or {}),  # the engine's own counters (running, waiting, steps, ...)
        "state": ctx.client.state,
        "pid": None if info is None else info.pid,
        "restarts": ctx.client.restarts,
        "in_flight": ctx.client.num_in_flight,
    }
    return doc


def build_app(ctx: ServingContext, *, manage_client: bool = True) -> FastAPI:
    """The app over a serving context. With `manage_client`, the app's lifespan starts the engine
    client (which launches the engine process) and stops it at shutdown."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if manage_client:
            await ctx.client.start()
        try:
            yield
        finally:
            if manage_client:
                await ctx.client.stop()

    app = FastAPI(title="FreeToken", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    install_error_handlers(app)

    def in_dialect(request: Request, err: APIError) -> Response:
        """An error body in the route's dialect: Anthropic's on `/v1/messages`, else OpenAI's."""
        if request.url.path.startswith("/v1/messages"):
            return anthropic_error_response(err, request_id_of(request))
        return err.response()

    async def on_http(request: Request, exc: Exception) -> Response:
        return in_dialect(request, http_error(request, exc))

    app.add_exception_handler(StarletteHTTPException, on_http)

    def check_api_key(request: Request) -> Response | None:
        key = ctx.config.api_key
        path = request.url.path
        keyed = path.startswith(KEYED_PREFIXES) or (ctx.config.unprefixed_routes and path not in OPEN_PATHS)
        if key is not None and keyed and not _authorized(request, key):
            err = APIError(
                401, "a valid API key is required: send 'Authorization: Bearer KEY' or 'x-api-key: KEY'", code="invalid_api_key"
            )
            if request.url.path.startswith("/v1/messages"):
                return anthropic_error_response(err, request_id_of(request))
            return err.response()
        return None

    # Inside the key check: only an authorized client learns the limit. A 413 is sent before the body is read.
    app.add_middleware(BodyLimit, max_bytes=ctx.config.max_request_bytes, render=in_dialect)
    app.add_middleware(Gate, check=check_api_key)  # pure ASGI: streamed chunks pass untouched

    app.add_middleware(RequestIdMiddleware)  # every response carries x-request-id
    if ctx.config.allowed_origins:  # outermost: preflight requests are answered before the key check
        app.add_middleware(
            CORSMiddleware, allow_origins=list(ctx.config.allowed_origins), allow_methods=["*"], allow_headers=["*"],
            expose_headers=["x-request-id"],
        )

    async def generation_route(
        endpoint: str,
        request: Request,
        model: type[M],
        handler: Callable[[ServingContext, M, str], Awaitable[Response]],
        *,
        anthropic: bool = False,
    ) -> Response:
        """Parse, run under --request-timeout, and render errors in the route's dialect."""
        request_id = request_id_of(request)
        deadline = Deadline.after(ctx.config.request_timeout_s)
        try:
            with ctx.drain.admitted():
                body = await parse_body(request, model)
                response = await deadline.run(cancel_on_disconnect(request, handler(ctx, body, request_id)))
        except APIError as err:
            ctx.metrics.record_request(endpoint, err.status)
            if anthropic:
                return anthropic_error_response(err, request_id)
            raise
        except FreeTokenError as exc:  # e.g. the engine went away between the checks and the call
            ctx.metrics.record_request(endpoint, 503)
            err = APIError(503, f"engine unavailable: {exc}", code="engine_unavailable")
            if anthropic:
                return anthropic_error_response(err, request_id)
            raise err from None
        except Exception as exc:  # the OpenAI routes leave this to the app's handler; Anthropic's need their own body
            if not anthropic:
                raise
            log.exception("unhandled error in %s request %s", endpoint, request_id)
            ctx.metrics.record_request(endpoint, 500)
            return anthropic_error_response(APIError(500, f"internal server error: {type(exc).__name__}: {exc}"), request_id)
        if response.status_code == CLIENT_CLOSED:
            ctx.metrics.record_request(endpoint, CLIENT_CLOSED)
            log.info("%s request %s: the client disconnected; the request was aborted", endpoint, request_id)
        if anthropic:
            return deadline.bound_stream(response, lambda e: error_event(e, request_id))
        return deadline.bound_stream(response, lambda e: sse(e.body()))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generation_route("completions", request, CompletionRequest, create_completion)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generation_route("chat", request, ChatCompletionRequest, create_chat_completion)

    responses = ResponseStore(ctx.config.responses_store_size, ctx.config.responses_store_ttl_s)
    threads = ThreadStore()  # /v1/messages `thread` conversations (the SDK tool runner's)

    @app.post("/v1/responses")
    async def create_response_route(request: Request) -> Response:
        return await generation_route("responses", request, ResponsesRequest, lambda c, r, rid: create_response(c, responses, r, rid))

    @app.get("/v1/responses/{response_id}")
    async def get_response_route(response_id: str) -> Response:
        return get_response(responses, response_id)

    @app.get("/v1/responses/{response_id}/input_items")
    async def list_input_items_route(response_id: str, limit: int = 20, order: str = "desc", after: str | None = None) -> Response:
        return list_input_items(responses, response_id, limit=limit, order=order, after=after)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response_route(response_id: str) -> Response:
        return delete_response(responses, response_id)

    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        return await generation_route(
            "messages", request, MessagesRequest, lambda c, r, rid: create_message(c, r, rid, threads), anthropic=True
        )

    @app.post("/v1/messages/count_tokens")
    async def messages_count_tokens(request: Request) -> Response:
        return await generation_route("count_tokens", request, CountTokensRequest, count_message_tokens, anthropic=True)

    @app.post("/v1/tokenize")
    async def tokenize_route(request: Request) -> Response:
        return await tokenize(ctx, await parse_body(request, TokenizeRequest))

    @app.post("/v1/chat/completions/render")
    async def chat_render(request: Request) -> Response:
        body = await parse_body(request, ChatCompletionRequest)
        return await anyio.to_thread.run_sync(lambda: JSONResponse(render_chat_request(ctx, body)))  # off the event loop

    @app.post("/v1/completions/render")
    async def completions_render(request: Request) -> Response:
        body = await parse_body(request, CompletionRequest)
        return await anyio.to_thread.run_sync(lambda: JSONResponse(render_completion_request(ctx, body)))  # off the event loop

    @app.post("/v1/detokenize")
    async def detokenize_route(request: Request) -> Response:
        return await detokenize(ctx, await parse_body(request, DetokenizeRequest))

    def model_card() -> dict[str, Any]:
        info = ctx.client.info
        return {
            "id": ctx.served_name,
            "object": "model",
            "created": int(started),
            "owned_by": "freetoken",
            "max_model_len": None if info is None else info.context_length,
        }

    started = time.time()

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        ctx.check_model(model_id)
        return model_card()

    @app.post("/admin/cache/resize")
    async def admin_cache_resize(request: Request) -> Response:
        try:
            return await resize_cache(ctx, await parse_body(request, ResizeRequest))
        except FreeTokenError as err:  # the engine went away between the checks and the call
            raise APIError(503, f"engine unavailable: {err}", code="engine_unavailable") from None

    @app.post("/admin/drain")
    async def admin_drain() -> Response:
        started = ctx.begin_drain("POST /admin/drain")
        return JSONResponse(
            {"status": "draining", "started": started, "in_flight": ctx.client.num_in_flight,
             "shutdown_timeout_s": ctx.config.shutdown_timeout_s},
            status_code=202,
        )

    @app.get("/health")
    async def health() -> Response:
        client = ctx.client
        info = client.info
        if ctx.drain.draining:
            return JSONResponse(
                {"status": "error", "message": "the server is shutting down (draining)", "state": "draining",
                 "restarts": client.restarts, "in_flight": client.num_in_flight},
                status_code=503, headers={"Retry-After": "30"},
            )
        if client.state != "ready" or info is None:
            reason = client.reason or ("the engine is loading" if client.state == "loading" else "the engine is down")
            return JSONResponse({"status": "error", "message": reason, "state": client.state, "restarts": client.restarts}, status_code=503)
        return JSONResponse(
            {
                "status": "ok",
                "model": ctx.served_name,
                "architecture": info.architecture,
                "context_length": info.context_length,
                "pid": info.pid,
                "restarts": client.restarts,
                "in_flight": client.num_in_flight,
            }
        )

    @app.get("/v1/cache/status")
    async def cache_status() -> dict[str, Any]:
        ctx.ready_info()
        try:
            return await engine_status(ctx)
        except (FreeTokenError, TimeoutError) as err:
            raise APIError(503, f"engine unavailable: {err or 'no status reply'}", code="engine_unavailable") from None

    @app.get("/metrics")
    async def metrics() -> Response:
        status = None
        if ctx.client.state == "ready":
            try:
                status = await engine_status(ctx)
            except (FreeTokenError, TimeoutError):
                status = None
        ctx.metrics.update_engine(
            up=ctx.client.state == "ready", restarts=ctx.client.restarts, in_flight=ctx.client.num_in_flight, status=status,
            hangs=ctx.client.hangs, heartbeat_max_gap_s=ctx.client.heartbeat.max_gap_s,
        )
        return Response(ctx.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    install_worker_routes(app, ctx, lambda: engine_status(ctx))  # /server_info, /model_info, /get_load, ...
    if ctx.config.unprefixed_routes:
        for route in list(app.routes):
            if isinstance(route, APIRoute) and route.path.startswith("/v1/") and not route.path.startswith(UNPREFIXED_EXCLUDED):
                path = route.path.removeprefix("/v1")
                app.add_api_route(path, route.endpoint, methods=list(route.methods), include_in_schema=False)
    app.state.serving = ctx
    log.debug("app built for %s (alias %r)", ctx.served_name, DEFAULT_MODEL_ALIAS)
    return app
