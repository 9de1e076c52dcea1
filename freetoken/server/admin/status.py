"""The engine's status document, as `/v1/cache/status`, `/metrics` and `/get_load` read it.

Owns `engine_status`: one `StatusQuery` round trip (bounded by `STATUS_TIMEOUT_S`) with every
DESIGN.md §4 field present and the API process's view of the engine (`state`, `pid`, `restarts`,
`in_flight`) in its `engine` block. It raises what the client raises (FreeTokenError, TimeoutError);
the routes decide what that answers.
"""

from __future__ import annotations

import asyncio
from typing import Any

from freetoken.server.context import ServingContext

STATUS_TIMEOUT_S = 10.0


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
