"""Resizing the KV pools at run time: the policy over `KVManager.resize` (DESIGN.md §3).

Owns what a resize may do: sizes in tokens -> pages; the floors (FULL: twice the pages of the
largest request in flight -- alone it must still fit, and a request that does not read the
cache, prompt logprobs, may commit its own pages beneath a tree prefix it duplicates, which then
cannot be evicted while it runs -- so that preemption always ends and no request waits forever;
SWA: the concurrency floor of `--max-running-requests` and `--max-prefill-length`); never below
the pages running requests hold; one shrink of a pool at a time; both pools checked before
either changes. The K/V tensors follow the pools: grown before a grow, shrunk once a shrink has
completed (`settle`). Ownership is never changed here: the manager drops the tree's references
above a shrink target and retires pages as their holders release them.

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

ResizeTensors = Callable[[str, int], None]  # (pool kind, pages): reallocate that pool's K/V


class ResizeRefused(FreeTokenError):
    """A resize that cannot be done now; `param` names the key, `conflict` means it is the
    state of the engine (409), not the value itself (400), that blocks it."""

    def __init__(self, message: str, param: str, conflict: bool = True) -> None:
        super().__init__(message)
        self.param = param
        self.conflict = conflict


def _targets(kv: KVManager, full_tokens: int | None, swa_tokens: int | None, page_size: int) -> dict[str, int]:
    wanted = {"full": full_tokens, "swa": swa_tokens}
    out: dict[str, int] = {}
    for kind, tokens in wanted.items():
        if tokens is None:
            continue
        key = f"{kind}_tokens"
        if kind == "swa" and kv.swa_pool is None:
            raise ResizeRefused(
                "this model has no sliding-window layers, so no SWA pool to resize", key, conflict=False
            )
        if tokens < page_size:
            raise ResizeRefused(
                f"{key} must be at least one page ({page_size} tokens), got {tokens}", key, conflict=False
            )
        out[kind] = tokens // page_size
    if not out:
        raise ResizeRefused("give full_tokens, swa_tokens or both", "full_tokens", conflict=False)
    return out


def resize_pools(
    kv: KVManager,
    resize_tensors: ResizeTensors,
    requests: Iterable[Request],
    *,
    full_tokens: int | None,
    swa_tokens: int | None,
    page_size: int,
    swa_floor: int | None,
) -> dict[str, dict[str, int]]:
    """Resize one or both pools; returns per pool resized its new size in pages and tokens and
    the pages still held above it. Raises ResizeRefused (nothing changed) naming what blocks it."""
    targets = _targets(kv, full_tokens, swa_tokens, page_size)
    needs = [math.ceil((len(r.prompt_ids) + r.params.max_tokens) / page_size) for r in requests]
    floors = {"full": 2 * max(needs, default=1) if needs else 1, "swa": swa_floor or 1}
    for kind, pages in targets.items():
        key = f"{kind}_tokens"
        pool = kv.full_pool if kind == "full" else kv.swa_pool
        assert pool is not None  # checked in _targets
        if pool.target != pool.capacity:
            raise ResizeRefused(
                f"the {kind} pool is still shrinking to {pool.target} pages: running requests hold "
                f"{pool.pending_release()} pages above it; retry when /v1/cache/status shows pending_release 0",
                key,
            )
        if pages < floors[kind]:
            why = (
                "twice the pages the largest request in flight needs"
                if kind == "full"
                else "the concurrency floor of --max-running-requests and --max-prefill-length"
            )
            raise ResizeRefused(
                f"{key} {pages * page_size} is below the {kind} pool's floor of {floors[kind]} pages "
                f"({floors[kind] * page_size} tokens): {why}",
                key,
            )
        held = kv.held_pages(kind)
        if pages < held:
            raise ResizeRefused(
                f"{key} {pages * page_size} is below the {held} pages ({held * page_size} tokens) "
                f"running requests hold in the {kind} pool",
                key,
            )
    out: dict[str, dict[str, int]] = {}
    for kind, pages in targets.items():
        if pages > kv.capacity(kind):
            resize_tensors(kind, pages)
        pending = kv.resize(kind, pages)
        out[kind] = {"capacity": pages, "tokens": pages * page_size, "pending_release": pending}
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
) -> dict[str, dict[str, int]]:
    """`resize_pools` for the pools given, and the expert cache to `expert_cache_gb` GiB when
    given (as `experts`: capacity_bytes, bytes held, freed_bytes). Checked before anything changes;
    raises ResizeRefused."""
    if expert_cache_gb is None:
        return resize_pools(
            kv,
            resize_tensors,
            requests,
            full_tokens=full_tokens,
            swa_tokens=swa_tokens,
            page_size=page_size,
            swa_floor=swa_floor,
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
    if full_tokens is not None or swa_tokens is not None:  # refused before anything changes
        out = resize_pools(
            kv,
            resize_tensors,
            requests,
            full_tokens=full_tokens,
            swa_tokens=swa_tokens,
            page_size=page_size,
            swa_floor=swa_floor,
        )
    freed = cache.resize(int(expert_cache_gb * GIB))
    out["experts"] = {"capacity_bytes": cache.capacity_bytes, "bytes": cache.bytes, "freed_bytes": freed}
    return out
