"""The router-probe routes as one `APIRouter` (sglang-router, vllm-router; docs/scale-out.md).

Owns the paths of `PROBE_PATHS` and what each answers on failure: `/server_info`,
`/get_server_info`, `/model_info`, `/get_model_info` (503 until the engine reports its model),
`/get_load` (503 when the engine gives no status) and `/health_generate` (503 with the reason
when the engine does not produce a token, or while draining). The answers themselves are
operations/worker_info.py's; like `/health` these routes need no API key.
"""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from freetoken.errors import FreeTokenError
from freetoken.server.admin.status import engine_status
from freetoken.server.context import ServingContext
from freetoken.server.errors import APIError
from freetoken.server.operations.worker_info import (
    MODEL_INFO_PATHS,
    SERVER_INFO_PATHS,
    ModelFacts,
    generate_one_token,
    load,
    model_facts,
    model_info,
    server_info,
)


def probe_router(ctx: ServingContext) -> APIRouter:
    router = APIRouter()
    facts: list[ModelFacts] = []  # computed on first use, once the engine has reported its architecture

    def the_facts() -> ModelFacts:
        if not facts:
            facts.append(model_facts(ctx.client.config.model, ctx.ready_info().architecture))
        return facts[0]

    for path in SERVER_INFO_PATHS:
        router.add_api_route(path, lambda: JSONResponse(server_info(ctx, the_facts())), methods=["GET"])
    for path in MODEL_INFO_PATHS:
        router.add_api_route(path, lambda: JSONResponse(model_info(ctx, the_facts())), methods=["GET"])

    @router.get("/get_load")
    async def get_load() -> Response:
        ctx.ready_info()
        try:
            return JSONResponse(await load(ctx, lambda: engine_status(ctx)))
        except (FreeTokenError, TimeoutError) as err:
            raise APIError(503, f"engine unavailable: {err or 'no status reply'}", code="engine_unavailable") from None

    @router.get("/health_generate")
    async def health_generate() -> Response:
        if ctx.drain.draining:
            return JSONResponse(
                {"status": "error", "message": "the server is shutting down (draining)"}, status_code=503
            )
        try:
            ctx.ready_info()
            await generate_one_token(ctx)
        except APIError as err:
            return JSONResponse({"status": "error", "message": err.message}, status_code=503)
        except (FreeTokenError, TimeoutError) as err:
            return JSONResponse(
                {"status": "error", "message": f"the engine did not generate: {err or 'timed out'}"}, status_code=503
            )
        return JSONResponse({"status": "ok"})

    return router
