"""Random interleavings of the engine's KV calls, with the full audit after every step.

A RuleBasedStateMachine plays an engine: admissions over shared prefixes (some longer than the
window, some with marked boundaries), chunked prefill with commits, decode steps across page and
window boundaries, batched steps, finish, abort, preemption with resume, and eviction under
pressure of either pool. Pools are small (<= 64 pages) so pressure is the normal case.
"""

from __future__ import annotations

import unittest

from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from freetoken.kv.manager import KVManager
from freetoken.kv.window import swa_floor
from kv_sim import Sim

MAX_RUNNING = 3
CHUNK = 8
PREFIXES = [list(range(100, 140)), list(range(100, 112)) + list(range(500, 530)), [7] * 30]

# (page_size, window, full_pages, cache_type): windows smaller and larger than a page and
# not a multiple of it; one model without SWA layers; the naive cache.
CONFIGS = {
    "p1_w5": (1, 5, 64, "radix"),
    "p1_w12": (1, 12, 64, "radix"),
    "p4_w3": (4, 3, 24, "radix"),
    "p4_w6": (4, 6, 24, "radix"),
    "p4_w13": (4, 13, 24, "radix"),
    "p4_full_only": (4, None, 24, "radix"),
    "p1_naive_w5": (1, 5, 64, "naive"),
}


class KVMachine(RuleBasedStateMachine):
    page_size = 1
    window: int | None = 5
    full_pages = 64
    cache_type = "radix"

    @initialize(extra_swa=st.integers(0, 8))
    def setup(self, extra_swa: int) -> None:
        swa = None
        if self.window is not None:
            floor = swa_floor(MAX_RUNNING, CHUNK, self.window, self.page_size)
            swa = min(64, floor + extra_swa)
        self.kv = KVManager(full_pages=self.full_pages, swa_pages=swa, page_size=self.page_size,
                            window=self.window, cache_type=self.cache_type)
        self.sim = Sim(self.kv, chunk=CHUNK, audit_every_step=False)
        self.waiting: list[tuple[str, list[int], int, tuple[int, ...]]] = []
        self.serial = 0

    def _new_id(self) -> str:
        self.serial += 1
        return f"r{self.serial}"

    def _try_admit(self, rid: str, prompt: list[int], max_tokens: int, bounds: tuple[int, ...],
                   use_cache: bool = True) -> None:
        self.sim.admit(rid, prompt, max_tokens, bounds, use_cache=use_cache)
        if not self.sim.schedule(rid):  # does not fit: lease released in the same step
            self.sim.running.pop(rid)
            self.kv.release(rid)
            self.waiting.append((rid, prompt, max_tokens, bounds))
            return
        self.sim.complete(rid)

    @precondition(lambda self: len(self.sim.running) < MAX_RUNNING)
    @rule(which=st.integers(0, len(PREFIXES) - 1), share=st.integers(0, 40),
          tail=st.lists(st.integers(0, 9), max_size=10), max_tokens=st.integers(1, 12),
          boundary=st.booleans(), use_cache=st.booleans())
    def admit(self, which, share, tail, max_tokens, boundary, use_cache) -> None:
        prompt = PREFIXES[which][:share] + tail
        if not prompt:
            prompt = [1]
        bounds = (share,) if boundary and 0 < share < len(prompt) else ()
        self._try_admit(self._new_id(), prompt, max_tokens, bounds, use_cache or share < 30)

    @precondition(lambda self: self.waiting and len(self.sim.running) < MAX_RUNNING)
    @rule()
    def resume(self) -> None:
        rid, prompt, max_tokens, bounds = self.waiting.pop(0)
        self._try_admit(rid + "'", prompt, max_tokens, bounds)

    @precondition(lambda self: self.sim.running)
    @rule(data=st.data(), batch=st.integers(1, MAX_RUNNING))
    def step(self, data, batch) -> None:
        live = [r for r, q in self.sim.running.items() if not q.done]
        if not live:
            return
        rids = data.draw(st.permutations(live))[:batch]
        scheduled = []
        for rid in rids:
            if self.sim.schedule(rid):
                scheduled.append(rid)
            else:  # out of pages: preempt it (commit what is written, stamp, release)
                req = self.sim.finish(rid, preempted=True)
                self.waiting.append((rid, req.tokens, max(1, req.max_tokens - len(req.output)),
                                     req.boundaries))
        for rid in scheduled:
            self.sim.complete(rid)

    @precondition(lambda self: self.sim.running)
    @rule(data=st.data(), commit=st.booleans())
    def finish_or_abort(self, data, commit) -> None:
        rid = data.draw(st.sampled_from(sorted(self.sim.running)))
        done = self.sim.running[rid].done
        self.sim.finish(rid, commit=commit or done)

    @precondition(lambda self: self.sim.running)
    @rule()
    def step_all(self) -> None:
        live = [r for r, q in self.sim.running.items() if not q.done]
        for rid in live:
            if not self.sim.schedule(rid):
                req = self.sim.finish(rid, preempted=True)
                self.waiting.append((rid, req.tokens, 1, req.boundaries))
        for rid in live:
            if rid in self.sim.running:
                self.sim.complete(rid)

    @rule(kind=st.sampled_from(["full", "swa"]), n=st.integers(1, 40), drain=st.integers(0, 5))
    def evict(self, kind, n, drain) -> None:
        """Eviction under pressure; now and then drain a pool completely and check that
        admission's promise (`available`) is exactly what eviction frees."""
        if kind == "swa" and self.kv.swa_pool is None:
            kind = "full"
        pool = self.kv.full_pool if kind == "full" else self.kv.swa_pool
        if drain:
            self.kv.evict(kind, n)
            return
        promised = self.kv.available(kind)
        self.kv.evict(kind, 10_000)
        assert pool.num_free == promised

    @invariant()
    def audit_clean(self) -> None:
        if hasattr(self, "sim"):
            self.sim.check()


def _case(name: str, cfg: tuple) -> type[unittest.TestCase]:
    page_size, window, full_pages, cache_type = cfg
    machine = type(f"KVMachine_{name}", (KVMachine,), dict(
        page_size=page_size, window=window, full_pages=full_pages, cache_type=cache_type))
    machine.TestCase.settings = settings(
        settings.get_profile("freetoken-kv"), max_examples=30, stateful_step_count=60)
    return machine.TestCase


for _name, _cfg in CONFIGS.items():
    globals()[f"TestKV_{_name}"] = _case(_name, _cfg)
