"""The OpenAI routes as one `APIRouter`: what the app includes for this protocol.

Owns the paths and their wiring: `POST /v1/completions` and `/v1/chat/completions` (through the
core's `run_endpoint`, in the server's default error dialect), vLLM's render routes
(`/v1/chat/completions/render`, `/v1/completions/render`), `/v1/tokenize`, `/v1/detokenize`,
and `GET /v1/models` (+ `/v1/models/{name}`, 404 `model_not_found` for another name). The work
of each route is in its own module (`chat`, `completions`, `render`, `tokenize`); nothing here
builds a generation or a body beyond the model card.
"""

from __future__ import annotations

import time
from typing import Any

import anyio.to_thread
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from freetoken.server.context import ServingContext
from freetoken.server.core.endpoint import run_endpoint
from freetoken.server.openai.chat import create_chat_completion
from freetoken.server.openai.completions import create_completion
from freetoken.server.openai.protocol import ChatCompletionRequest, CompletionRequest
from freetoken.server.openai.render import render_chat_request, render_completion_request
from freetoken.server.operations.request_log import request_line
from freetoken.server.openai.tokenize import DetokenizeRequest, TokenizeRequest, detokenize, tokenize
from freetoken.server.request_body import parse_body


def model_card(ctx: ServingContext, created: float) -> dict[str, Any]:
    """The one entry of `/v1/models`: the served name, the context length and the checkpoint's
    sampling defaults where it has some (`--sampling-defaults model`)."""
    info = ctx.client.info
    card = {
        "id": ctx.served_name,
        "object": "model",
        "created": int(created),
        "owned_by": "freetoken",
        "max_model_len": None if info is None else info.context_length,
    }
    if ctx.sampling_defaults.values:
        card["sampling_defaults"] = dict(ctx.sampling_defaults.values)
    return card


def openai_router(ctx: ServingContext) -> APIRouter:
    router = APIRouter()
    started = time.time()

    @router.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await run_endpoint(ctx, "completions", request, CompletionRequest, create_completion)

    @router.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await run_endpoint(ctx, "chat", request, ChatCompletionRequest, create_chat_completion)

    @router.post("/v1/tokenize")
    async def tokenize_route(request: Request) -> Response:
        line = request_line(request.scope)
        line.route = "tokenize"
        return await tokenize(ctx, await parse_body(request, TokenizeRequest), line)

    @router.post("/v1/chat/completions/render")
    async def chat_render(request: Request) -> Response:
        body = await parse_body(request, ChatCompletionRequest)
        return await anyio.to_thread.run_sync(
            lambda: JSONResponse(render_chat_request(ctx, body))
        )  # off the event loop

    @router.post("/v1/completions/render")
    async def completions_render(request: Request) -> Response:
        body = await parse_body(request, CompletionRequest)
        return await anyio.to_thread.run_sync(
            lambda: JSONResponse(render_completion_request(ctx, body))
        )  # off the event loop

    @router.post("/v1/detokenize")
    async def detokenize_route(request: Request) -> Response:
        request_line(request.scope).route = "detokenize"
        return await detokenize(ctx, await parse_body(request, DetokenizeRequest))

    @router.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card(ctx, started)]}

    @router.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        ctx.check_model(model_id)
        return model_card(ctx, started)

    return router
