"""Resizing the KV pools at run time: the policy over `KVManager.resize` (DESIGN.md §3).

Owns what a resize may do: sizes in tokens -> pages (a hybrid model's state pool: in slots); the
floors (FULL: twice the pages of the largest request in flight -- alone it must still fit, and a
request that does not read the cache, prompt logprobs, may commit its own pages beneath a tree
prefix it duplicates, which then cannot be evicted while it runs -- so that preemption always
ends and no request waits forever; SWA: the concurrency floor of `--max-running-requests` and
`--max-prefill-length`; state: one slot per running request and STATE_SLOTS_SPARE, what start-up
gives it with no snapshot slot); never below the pages running requests hold; one shrink of a
pool at a time; every pool checked before any changes. The tensors follow the pools: grown
before a grow, shrunk once a shrink has completed (`settle`). Ownership is never changed here:
the manager drops the tree's references above a shrink target (the state pool's snapshots that
fit below it move there, kv/snapshots.py) and retires pages as their holders release them.

The expert cache of `--moe-strategy offload` shares the budget (`resize_memory`): in one call the
bytes can move between it and the KV pools: the pools are checked and resized first (a refusal
changes nothing), then the cache (a shrink frees at once; an evicted expert is decoded again from
its backing store when next routed to). A KV shrink completes as running requests release pages.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

from freetoken.errors import FreeTokenError
from freetoken.kv.manager import KVManager
from freetoken.models.experts_cache import GIB, ExpertCache
from freetoken.request import Request

ResizeTensors = Callable[[str, int], None]  # (pool kind, pages): reallocate that pool's tensors
STATE_SLOTS_SPARE = 2  # state slots beyond --max-running-requests: a quarantined slot costs no concurrency


def state_floor(max_running_requests: int) -> int:
    """The smallest state pool: a slot per running request and the spare ones."""
    return max_running_requests + STATE_SLOTS_SPARE


class ResizeRefused(FreeTokenError):
    """A resize that cannot be done now; `param` names the key, `conflict` means it is the
    state of the engine (409), not the value itself (400), that blocks it."""

    def __init__(self, message: str, param: str, conflict: bool = True) -> None:
        super().__init__(message)
        self.param = param
        self.conflict = conflict


def _key(kind: str) -> str:
    return "state_slots" if kind == "state" else f"{kind}_tokens"


def _targets(
    kv: KVManager, full_tokens: int | None, swa_tokens: int | None, state_slots: int | None, page_size: int
) -> dict[str, int]:
    wanted = {"full": full_tokens, "swa": swa_tokens}
    out: dict[str, int] = {}
    for kind, tokens in wanted.items():
        if tokens is None:
            continue
        key = _key(kind)
        if kind == "swa" and kv.swa_pool is None:
            raise ResizeRefused(
                "this model has no sliding-window layers, so no SWA pool to resize", key, conflict=False
            )
        if tokens < page_size:
            raise ResizeRefused(
                f"{key} must be at least one page ({page_size} tokens), got {tokens}", key, conflict=False
            )
        out[kind] = tokens // page_size
    if state_slots is not None:
        if kv.state_pool is None:
            raise ResizeRefused(
                "this model has no linear-attention layers, so no recurrent-state pool to resize",
                "state_slots",
                conflict=False,
            )
        if state_slots < 1:
            raise ResizeRefused(f"state_slots must be at least 1, got {state_slots}", "state_slots", conflict=False)
        out["state"] = state_slots
    if not out:
        raise ResizeRefused("give full_tokens, swa_tokens, state_slots or several", "full_tokens", conflict=False)
    return out


def _sizes(kind: str, n: int, page_size: int) -> str:
    return f"{n} slots" if kind == "state" else f"{n} pages ({n * page_size} tokens)"


def resize_pools(
    kv: KVManager,
    resize_tensors: ResizeTensors,
    requests: Iterable[Request],
    *,
    full_tokens: int | None,
    swa_tokens: int | None,
    page_size: int,
    swa_floor: int | None,
    state_slots: int | None = None,
    state_floor: int | None = None,
) -> dict[str, dict[str, int]]:
    """Resize one or more pools; returns per pool resized its new size (`capacity`: pages, with
    `tokens`; the state pool: slots) and the pages still held above it (`pending_release`).
    Raises ResizeRefused (nothing changed) naming what blocks it."""
    targets = _targets(kv, full_tokens, swa_tokens, state_slots, page_size)
    needs = [math.ceil((len(r.prompt_ids) + r.params.max_tokens) / page_size) for r in requests]
    floors = {"full": 2 * max(needs, default=1) if needs else 1, "swa": swa_floor or 1, "state": state_floor or 1}
    why = {
        "full": "twice the pages the largest request in flight needs",
        "swa": "the concurrency floor of --max-running-requests and --max-prefill-length",
        "state": f"a slot per running request (--max-running-requests) and {STATE_SLOTS_SPARE} spare",
    }
    for kind, pages in targets.items():
        key = _key(kind)
        pool = kv.full_pool if kind == "full" else kv.swa_pool if kind == "swa" else kv.state_pool
        assert pool is not None  # checked in _targets
        if pool.target != pool.capacity:
            unit = "slots" if kind == "state" else "pages"
            raise ResizeRefused(
                f"the {kind} pool is still shrinking to {pool.target} {unit}: running requests hold "
                f"{pool.pending_release()} {unit} above it; retry when /v1/cache/status shows pending_release 0",
                key,
            )
        given = pages if kind == "state" else pages * page_size
        if pages < floors[kind]:
            raise ResizeRefused(
                f"{key} {given} is below the {kind} pool's floor of {_sizes(kind, floors[kind], page_size)}: "
                f"{why[kind]}",
                key,
            )
        held = kv.held_pages(kind)
        if pages < held:
            raise ResizeRefused(
                f"{key} {given} is below the {_sizes(kind, held, page_size)} running requests hold in the {kind} pool",
                key,
            )
    out: dict[str, dict[str, int]] = {}
    for kind, pages in targets.items():
        if pages > kv.capacity(kind):
            resize_tensors(kind, pages)
        pending = kv.resize(kind, pages)
        tokens = {} if kind == "state" else {"tokens": pages * page_size}
        out[kind] = {"capacity": pages, **tokens, "pending_release": pending}
    settle(kv, resize_tensors)
    return out


def settle(kv: KVManager, resize_tensors: ResizeTensors) -> None:
    """Complete the shrinks whose pages above the target are all released (after each step)."""
    if kv.shrinking():
        for kind in kv.finish_shrinks():
            resize_tensors(kind, kv.capacity(kind))


def resize_memory(
    kv: KVManager,
    resize_tensors: ResizeTensors,
    requests: Iterable[Request],
    cache: ExpertCache | None,
    *,
    full_tokens: int | None,
    swa_tokens: int | None,
    expert_cache_gb: float | None,
    page_size: int,
    swa_floor: int | None,
    state_slots: int | None = None,
    state_floor: int | None = None,
) -> dict[str, dict[str, int]]:
    """`resize_pools` for the pools given, and the expert cache to `expert_cache_gb` GiB when
    given (as `experts`: capacity_bytes, bytes held, freed_bytes). Checked before anything changes;
    raises ResizeRefused."""
    pools = {"full_tokens": full_tokens, "swa_tokens": swa_tokens, "state_slots": state_slots}
    if expert_cache_gb is None:
        return resize_pools(
            kv,
            resize_tensors,
            requests,
            full_tokens=full_tokens,
            swa_tokens=swa_tokens,
            page_size=page_size,
            swa_floor=swa_floor,
            state_slots=state_slots,
            state_floor=state_floor,
        )
    if cache is None:
        raise ResizeRefused(
            "expert_cache_gb needs a MoE model served with --moe-strategy offload", "expert_cache_gb", conflict=False
        )
    if expert_cache_gb < 0:
        raise ResizeRefused(
            f"expert_cache_gb must be at least 0, got {expert_cache_gb}", "expert_cache_gb", conflict=False
        )
    out: dict[str, dict[str, int]] = {}
    if any(v is not None for v in pools.values()):  # refused before anything changes
        out = resize_pools(
            kv,
            resize_tensors,
            requests,
            full_tokens=full_tokens,
            swa_tokens=swa_tokens,
            page_size=page_size,
            swa_floor=swa_floor,
            state_slots=state_slots,
            state_floor=state_floor,
        )
    freed = cache.resize(int(expert_cache_gb * GIB))
    out["experts"] = {"capacity_bytes": cache.capacity_bytes, "bytes": cache.bytes, "freed_bytes": freed}
    return out
