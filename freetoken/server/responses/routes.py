"""The Responses routes as one `APIRouter`, and the reads of stored responses.

Owns `POST /v1/responses` (through the core's `run_endpoint`; the work is create.py's), `GET` /
`DELETE /v1/responses/{id}` and `GET /v1/responses/{id}/input_items` over the router's own
`ResponseStore` (bounded by `--responses-store-size` / `--responses-store-ttl`). An unknown id is
a 404 `response_not_found`.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from freetoken.server.context import ServingContext
from freetoken.server.core.endpoint import run_endpoint
from freetoken.server.errors import APIError, bad_request
from freetoken.server.responses.create import create_response
from freetoken.server.responses.protocol import ResponsesRequest
from freetoken.server.responses.store import ResponseStore


def responses_router(ctx: ServingContext) -> APIRouter:
    router = APIRouter()
    store = ResponseStore(ctx.config.responses_store_size, ctx.config.responses_store_ttl_s)

    @router.post("/v1/responses")
    async def create_response_route(request: Request) -> Response:
        return await run_endpoint(
            ctx, "responses", request, ResponsesRequest, lambda c, r, rid: create_response(c, store, r, rid)
        )

    @router.get("/v1/responses/{response_id}")
    async def get_response_route(response_id: str) -> Response:
        return get_response(store, response_id)

    @router.get("/v1/responses/{response_id}/input_items")
    async def list_input_items_route(
        response_id: str, limit: int = 20, order: str = "desc", after: str | None = None
    ) -> Response:
        return list_input_items(store, response_id, limit=limit, order=order, after=after)

    @router.delete("/v1/responses/{response_id}")
    async def delete_response_route(response_id: str) -> Response:
        return delete_response(store, response_id)

    return router


def not_found(response_id: str) -> APIError:
    return APIError(404, f"Response with id '{response_id}' not found.", param="response_id", code="response_not_found")


def get_response(store: ResponseStore, response_id: str) -> Response:
    entry = store.get(response_id)
    if entry is None:
        raise not_found(response_id)
    return JSONResponse(entry.body)


def list_input_items(store: ResponseStore, response_id: str, *, limit: int, order: str, after: str | None) -> Response:
    """A stored response's input items, newest first unless `order` is "asc", `limit` at a time after the item `after`."""
    entry = store.get(response_id)
    if entry is None:
        raise not_found(response_id)
    if not 1 <= limit <= 100:
        raise bad_request(f"limit must be in [1, 100], got {limit}", param="limit")
    if order not in ("asc", "desc"):
        raise bad_request(f"order must be 'asc' or 'desc', got {order!r}", param="order")
    items = list(entry.input_items if order == "asc" else reversed(entry.input_items))
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise bad_request(f"after: no input item {after!r} in response '{response_id}'", param="after")
        items = items[ids.index(after) + 1 :]
    page = items[:limit]
    return JSONResponse(
        {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(items) > limit,
        }
    )


def delete_response(store: ResponseStore, response_id: str) -> Response:
    if not store.delete(response_id):
        raise not_found(response_id)
    return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})
