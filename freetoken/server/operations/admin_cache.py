"""`POST /admin/cache/resize`: resize the engine's KV pools and expert cache at run time (behind the API key).

Owns the route's body (`{"full_tokens": N, "swa_tokens": M, "state_slots": S,
"expert_cache_gb": G}`, any of them, pools in tokens, a hybrid model's recurrent-state pool in
slots, the `--moe-strategy offload` expert cache in GiB; an unknown key or a value that is not a
positive integer (G: a number >= 0) is a 400 naming it) and the mapping of the engine's answer to
HTTP: 200 with the new sizes (`pools.<kind>.capacity` in pages (state: slots), `tokens`,
`pending_release`: pages running requests still hold above a shrink's target; /v1/cache/status
shows them go; `pools.experts`: `capacity_bytes`, `bytes`, `freed_bytes`), 409 naming the key when the engine's state blocks it (a floor, pages running
requests hold, a shrink still in progress), 400 when the value itself cannot work. The policy is
the engine's (`freetoken/engine/resize.py`); this module never imports torch.
"""

from __future__ import annotations

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from freetoken.server.context import ServingContext
from freetoken.server.errors import APIError, bad_request


class ResizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    full_tokens: int | None = Field(default=None, ge=1)
    swa_tokens: int | None = Field(default=None, ge=1)
    state_slots: int | None = Field(default=None, ge=1)
    expert_cache_gb: float | None = Field(default=None, ge=0)


async def resize_cache(ctx: ServingContext, req: ResizeRequest) -> JSONResponse:
    ctx.ready_info()
    if all(v is None for v in (req.full_tokens, req.swa_tokens, req.state_slots, req.expert_cache_gb)):
        raise bad_request(
            "give full_tokens, swa_tokens (tokens of KV memory per pool), state_slots (a hybrid model's "
            "recurrent-state slots) or expert_cache_gb",
            param="full_tokens",
        )
    answer = await ctx.client.resize_cache(req.full_tokens, req.swa_tokens, req.expert_cache_gb, req.state_slots)
    if not answer.get("ok"):
        message, param = str(answer.get("error")), answer.get("param")
        if answer.get("conflict"):
            raise APIError(409, message, param=param if isinstance(param, str) else None, code="resize_blocked")
        raise bad_request(message, param=param if isinstance(param, str) else None)
    return JSONResponse({"status": "ok", "pools": answer.get("pools")})
