"""Bugs injected into the engine for the mixed driver's negative controls (test_kv_mixed_negative.py).

Each `Bug` patches one thing the mixed driver's rules exercise (resize, drafting, pins and
forced eviction, starvation, reasoning budgets, finish) with a plausible mistake that keeps every
reference count right, so the audit (A1-A6) cannot see it; `expect` is a fragment of the
driver's failure message that names what caught it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest

from freetoken.engine.engine import Engine
from freetoken.kv.manager import KVManager
from freetoken.kv.tensors import KVTensors
from freetoken.kv.tree import RadixTree
from freetoken.kv.window import num_pages
from freetoken.reasoning_budget import ReasoningState
from freetoken.engine.scheduler import Scheduler
from freetoken.request import Request, RequestStatus


@dataclass(frozen=True)
class Bug:
    name: str
    rule: str  # the driver rule whose code it breaks
    apply: Callable[[pytest.MonkeyPatch], None]
    expect: tuple[str, ...]  # one of these is in the driver's failure message


def _resize_tensors(drop_scales: bool, lose_last_page: bool) -> Callable[..., None]:
    """`KVTensors.resize` with one mistake: no int8 scale copy, or one page fewer copied."""

    def resize(self: KVTensors, sliding: bool, pages: int) -> None:
        for i, s in enumerate(self.sliding):
            if s != sliding:
                continue
            for kv in (self.k, self.v):
                old = kv[i]
                new = self._zeros((pages + 1, *old.shape[1:]))
                keep = min(pages + 1, old.shape[0]) - (1 if lose_last_page else 0)
                new[:keep] = old[:keep]
                if self.quantized and not drop_scales:
                    new.kv_scale[:keep] = old.kv_scale[:keep]  # type: ignore[attr-defined]
                kv[i] = new
        if sliding:
            self.num_swa_pages = pages
        else:
            self.num_full_pages = pages

    return resize


def _resize_scales(mp: pytest.MonkeyPatch) -> None:
    mp.setattr(KVTensors, "resize", _resize_tensors(drop_scales=True, lose_last_page=False))


def _resize_page(mp: pytest.MonkeyPatch) -> None:
    mp.setattr(KVTensors, "resize", _resize_tensors(drop_scales=False, lose_last_page=True))


def _shrink_keeps_tree(mp: pytest.MonkeyPatch) -> None:
    """A shrink that skips the release of the tree's references above the target."""
    mp.setattr(RadixTree, "drop", lambda self, kind, pages: None)


def _accept_short(mp: pytest.MonkeyPatch) -> None:
    """`accept` keeping the pages of written - 1 tokens: the page of the last accepted token goes
    back when it is alone on it (the release itself is a correct decref)."""
    original = KVManager.accept

    def accept(self: KVManager, rid: str, written: int) -> int:
        req = self._requests[rid]
        keep = num_pages(written - 1, self.page_size)
        if keep < num_pages(written, self.page_size):
            extra = len(req.full) - keep
            full, req.full = req.full[keep:], req.full[:keep]
            self.full_pool.decref([p for p in full if p])
            if req.swa is not None and self.swa_pool is not None:
                swa, req.swa = req.swa[keep:], req.swa[:keep]
                self.swa_pool.decref([p for p in swa if p])
            req.draft_pending = False
            return extra
        return original(self, rid, written)

    mp.setattr(KVManager, "accept", accept)


def _evict_ignores_pins(mp: pytest.MonkeyPatch) -> None:
    """A FULL eviction pass that does not look at the pins' deadlines."""
    original = RadixTree.evict_full

    def evict_full(self: RadixTree, need: int) -> int:
        saved = {n: n.pin_until for n in self.nodes()}
        for n in saved:
            n.pin_until = 0.0
        try:
            return original(self, need)
        finally:
            for n, until in saved.items():
                n.pin_until = until

    mp.setattr(RadixTree, "evict_full", evict_full)


def _pins_never_released(mp: pytest.MonkeyPatch) -> None:
    """A scheduler whose starved request does not get the pins released."""
    mp.setattr(KVManager, "release_pins", lambda self: False)


def _preempt_restarts_budget(mp: pytest.MonkeyPatch) -> None:
    """A preemption that starts the request's reasoning budget over (its output is kept, so the
    budget must go on from where it was)."""
    original = Scheduler.preempt

    def preempt(self: Scheduler, req: Request) -> None:
        original(self, req)
        if req.reasoning is not None:
            req.reasoning = ReasoningState(req.reasoning.budget)

    mp.setattr(Scheduler, "preempt", preempt)


def _finish_commits_unwritten(mp: pytest.MonkeyPatch) -> None:
    """Finish commits prompt + output (the last sampled token's K/V was never written)."""
    original = Engine._finish

    def finish(self: Engine, req, reason, error=None) -> None:  # type: ignore[no-untyped-def]
        if req.status is RequestStatus.RUNNING and req.output_ids:
            held = len(self.kv.page_tables(req.rid)[0]) * self.kv.page_size
            self.kv.commit(req.rid, req.all_ids[: min(req.num_computed + 1, held)], boundaries=req.boundaries)
        original(self, req, reason, error)

    mp.setattr(Engine, "_finish", finish)


BUGS = [
    Bug("int8 resize drops the scales", "resize", _resize_scales, ("holds",)),
    Bug("resize loses the last page it keeps", "resize", _resize_page, ("holds",)),
    Bug("shrink skips the tree's release above the target", "resize", _shrink_keeps_tree, ("shrink is still pending",)),
    Bug("accept releases the last accepted token's page", "arrive (drafting)", _accept_short, ("written tokens, not",)),
    Bug("eviction ignores pins", "evict / advance_clock (pins)", _evict_ignores_pins, ("pinned nodes",)),
    Bug("a starved request does not release the pins", "arrive (large)", _pins_never_released, ("pins starve",)),
    Bug("preemption restarts the reasoning budget", "arrive (reasoning budget)", _preempt_restarts_budget,
        ("greedy continuation",)),
    Bug("finish commits the unwritten last token", "abort / finish", _finish_commits_unwritten, ("holds",)),
]
