"""The operator routes as one `APIRouter`: health, cache status, metrics, drain, cache resize,
and the dashboard.

Owns `GET /health` (200 while serving; 503 with the reason while loading, restarting, down or
draining), `GET /v1/cache/status` (the engine's status document, status.py), `GET /metrics`
(Prometheus text, refreshed from the engine when it is up), `POST /admin/drain` (202: stop
admitting, finish in-flight requests, then stop; docs/operations.md) and `POST
/admin/cache/resize` (operations/admin_cache.py); `GET /` (the dashboard page, dashboard.py) and
`GET /admin/activity` (its JSON: tok/s history, recent requests, totals; activity.py). The API key
guards `/admin/...` and `/v1/...`
(the app's gate); `/health`, `/metrics` and the page `/` stay open. It reaches the engine only through the
serving context's client.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from freetoken.errors import FreeTokenError
from freetoken.server.admin.activity import activity_document
from freetoken.server.admin.dashboard import DASHBOARD_PATH, dashboard_page, dashboard_response
from freetoken.server.admin.status import engine_status
from freetoken.server.context import ServingContext
from freetoken.server.errors import APIError
from freetoken.server.operations.admin_cache import ResizeRequest, resize_cache
from freetoken.server.request_body import parse_body


def health(ctx: ServingContext) -> Response:
    client = ctx.client
    info = client.info
    if ctx.drain.draining:
        return JSONResponse(
            {
                "status": "error",
                "message": "the server is shutting down (draining)",
                "state": "draining",
                "restarts": client.restarts,
                "in_flight": client.num_in_flight,
            },
            status_code=503,
            headers={"Retry-After": "30"},
        )
    if client.state != "ready" or info is None:
        reason = client.reason or ("the engine is loading" if client.state == "loading" else "the engine is down")
        return JSONResponse(
            {"status": "error", "message": reason, "state": client.state, "restarts": client.restarts}, status_code=503
        )
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


async def metrics_text(ctx: ServingContext) -> Response:
    status = None
    if ctx.client.state == "ready":
        try:
            status = await engine_status(ctx)
        except (FreeTokenError, TimeoutError):
            status = None
    ctx.metrics.update_engine(
        up=ctx.client.state == "ready",
        restarts=ctx.client.restarts,
        in_flight=ctx.client.num_in_flight,
        status=status,
        hangs=ctx.client.hangs,
        heartbeat_max_gap_s=ctx.client.heartbeat.max_gap_s,
    )
    return Response(ctx.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


def admin_router(ctx: ServingContext) -> APIRouter:
    router = APIRouter()
    page = dashboard_page()

    @router.get(DASHBOARD_PATH, include_in_schema=False)
    async def dashboard() -> Response:
        return dashboard_response(page)

    @router.get("/admin/activity")
    async def admin_activity() -> dict[str, Any]:
        return activity_document(ctx)

    @router.post("/admin/cache/resize")
    async def admin_cache_resize(request: Request) -> Response:
        try:
            return await resize_cache(ctx, await parse_body(request, ResizeRequest))
        except FreeTokenError as err:  # the engine went away between the checks and the call
            raise APIError(503, f"engine unavailable: {err}", code="engine_unavailable") from None

    @router.post("/admin/drain")
    async def admin_drain() -> Response:
        started = ctx.begin_drain("POST /admin/drain")
        return JSONResponse(
            {
                "status": "draining",
                "started": started,
                "in_flight": ctx.client.num_in_flight,
                "shutdown_timeout_s": ctx.config.shutdown_timeout_s,
            },
            status_code=202,
        )

    @router.get("/health")
    async def health_route() -> Response:
        return health(ctx)

    @router.get("/v1/cache/status")
    async def cache_status() -> dict[str, Any]:
        ctx.ready_info()
        try:
            return await engine_status(ctx)
        except (FreeTokenError, TimeoutError) as err:
            raise APIError(503, f"engine unavailable: {err or 'no status reply'}", code="engine_unavailable") from None

    @router.get("/metrics")
    async def metrics() -> Response:
        return await metrics_text(ctx)

    return router
