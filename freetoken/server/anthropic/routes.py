"""The Anthropic routes as one `APIRouter`: `POST /v1/messages` and `/v1/messages/count_tokens`.

Owns their wiring: both run through the core's `run_endpoint` in Anthropic's error dialect
(`ANTHROPIC_DIALECT`, errors.py), and `/v1/messages` keeps `thread` conversations in the
router's own `ThreadStore`. `PATH_PREFIX` is where the dialect applies, for the app's answers
that come before any route (401, 404, 405, 413). The work is in messages.py.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from freetoken.server.anthropic.errors import ANTHROPIC_DIALECT
from freetoken.server.anthropic.messages import count_message_tokens, create_message
from freetoken.server.anthropic.protocol import CountTokensRequest, MessagesRequest
from freetoken.server.anthropic.threads import ThreadStore
from freetoken.server.context import ServingContext
from freetoken.server.core.endpoint import run_endpoint

PATH_PREFIX = "/v1/messages"


def anthropic_router(ctx: ServingContext) -> APIRouter:
    router = APIRouter()
    threads = ThreadStore()  # /v1/messages `thread` conversations (the SDK tool runner's)

    @router.post(PATH_PREFIX)
    async def messages(request: Request) -> Response:
        return await run_endpoint(
            ctx,
            "messages",
            request,
            MessagesRequest,
            lambda c, r, rid: create_message(c, r, rid, threads),
            ANTHROPIC_DIALECT,
        )

    @router.post(f"{PATH_PREFIX}/count_tokens")
    async def messages_count_tokens(request: Request) -> Response:
        return await run_endpoint(
            ctx, "count_tokens", request, CountTokensRequest, count_message_tokens, ANTHROPIC_DIALECT
        )

    return router
