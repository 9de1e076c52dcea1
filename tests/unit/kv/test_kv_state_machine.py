"""Hypothesis drives the real engine (its scheduler, shared prefill budget, commit points,
preemption) over a null model: arrivals over shared prefixes (long prompts of several windows,
short prompts sharing their first tokens, continuations, prompt-logprob requests), steps,
aborts, forced eviction passes, retention pins (a request's breakpoint, on a fake clock that
rules advance; no eviction may remove a live pin) and run-time resizes of either pool (grow, shrink below what the
tree holds, shrink while running requests hold pages above the new size), on small pools. Every KV call is followed by the shadow
check (each holder holds the tokens it claims) and the full audit; the machine's teardown
drains the engine and checks the idle state (A5).

`event()` reports which dangerous situations each example reached (run pytest with
`--hypothesis-show-statistics` to see them) and `target()` steers the search towards more
tombstone hits, heals, preemptions, evictions under a held path and seed-shaped commits -- in
Hypothesis's target phase, which runs only with FT_KV_TARGET=1: its hill climbing has no budget
of its own (up to ~1000 calls of a test whose every call drives an engine), and one CI run spent
over 15 minutes in it. The default run generates, shrinks and explains as usual.
"""

from __future__ import annotations

import unittest

import os

from hypothesis import Phase, event, settings, strategies as st, target
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

from engine_sim import VOCAB, Setup, drain, make_engine, step, submit
from freetoken.engine.engine import RequestRefused
from freetoken.engine.resize import ResizeRefused
from freetoken.kv.pins import live_pins
from freetoken.request import Request

LONG = [1 + (i * 29) % (VOCAB - 1) for i in range(40)]
PREFIXES = [LONG, LONG[:6] + [90 + i for i in range(20)], [7] * 14]

TARGETS = {
    "hit through a tombstone": "tombstone hits",
    "heal": "heals",
    "preemption": "preemptions",
    "swa eviction under a request-held path": "SWA evictions under a held path",
    "full eviction under a request-held path": "full evictions under a held path",
    "commit beneath a tombstone another request holds": "commits beneath a held tombstone",
}

SETUPS = {
    "p1_w5": Setup(1, 5, 48),
    "p2_w7": Setup(2, 7, 28, max_running=4, chunk=10),
    "p4_w6": Setup(4, 6, 16),
    "p4_full_only": Setup(4, None, 16),
}


class EngineMachine(RuleBasedStateMachine):
    setup_: Setup = SETUPS["p1_w5"]

    @initialize()
    def start(self) -> None:
        self.now = 0.0
        self.engine = make_engine(self.setup_, clock=lambda: self.now)
        self.pinned: list = []  # nodes pinned at the last check (a shrink may drop them)
        self.live: dict[str, Request] = {}
        self.finished: list[list[int]] = []
        self.serial = 0

    def _collect(self) -> None:
        for rid in [r for r, q in self.live.items() if q.finished]:
            req = self.live.pop(rid)
            if req.output_ids:
                self.finished.append(req.all_ids[:-1])

    @rule(which=st.integers(0, len(PREFIXES) - 1), share=st.integers(0, 40),
          tail=st.lists(st.integers(0, VOCAB - 1), max_size=8), max_tokens=st.integers(1, 12),
          boundary=st.booleans(), logprobs=st.booleans(), follow=st.booleans(),
          pin=st.one_of(st.none(), st.tuples(st.integers(1, 40), st.sampled_from([5.0, 30.0, 300.0]))))
    def arrive(self, which, share, tail, max_tokens, boundary, logprobs, follow, pin) -> None:
        if follow and self.finished:
            base = self.finished[share % len(self.finished)]
            prompt, bounds = base + tail[:3] + [5], (len(base),)
        else:
            prompt = PREFIXES[which][:share] + tail or [1]
            bounds = (share,) if boundary and 0 < share < len(prompt) else ()
        cap = self.engine.config.full_pages * self.setup_.page_size
        if len(prompt) + max_tokens > cap // 2:
            return
        self.serial += 1
        rid = f"r{self.serial}"
        try:
            pins = ((min(pin[0], len(prompt)), pin[1]),) if pin is not None else ()
            self.live[rid] = submit(self.engine, rid, prompt, max_tokens, bounds,
                                    0 if logprobs and share % 5 == 0 else None, pins)
        except RequestRefused:  # past a pool shrunk below it
            event("arrival refused after a shrink")

    @precondition(lambda self: self.engine.has_work())
    @rule(n=st.integers(1, 4))
    def run_steps(self, n: int) -> None:
        self._snapshot_pins()
        for _ in range(n):
            step(self.engine)
        self._check_pins()
        self._collect()

    def _snapshot_pins(self) -> None:
        tree = self.engine.kv.tree
        self.pinned = [] if tree is None else live_pins(tree)

    def _check_pins(self) -> None:
        gone = [n for n in self.pinned if n.parent is None and n.pin_until > self.now]
        assert not gone, f"eviction removed {len(gone)} pinned nodes"
        if self.pinned:
            event("a live pin survived steps or an eviction pass")

    @rule(dt=st.sampled_from([1.0, 10.0, 100.0]))
    def advance_clock(self, dt: float) -> None:
        self.now += dt

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def abort(self, data) -> None:
        rid = data.draw(st.sampled_from(sorted(self.live)))
        self.engine.abort(rid)
        step(self.engine)
        self._collect()

    @rule(swa=st.booleans(), n=st.integers(1, 30))
    def evict(self, swa: bool, n: int) -> None:
        kv = self.engine.kv
        if kv.tree is not None:
            self._snapshot_pins()
            kv.evict("swa" if swa and kv.swa_pool is not None else "full", n)
            self._check_pins()

    @rule(swa=st.booleans(), share=st.floats(0.25, 1.75))
    def resize(self, swa: bool, share: float) -> None:
        """Resize a pool to a share of its start-up size; a refusal must change nothing."""
        kv, p = self.engine.kv, self.setup_.page_size
        kind = "swa" if swa and kv.swa_pool is not None else "full"
        start = self.engine.config.swa_pages if kind == "swa" else self.engine.config.full_pages
        tokens = max(1, int((start or 1) * share)) * p
        before = kv.status()["pools"]
        try:
            self.engine.resize(**{f"{kind}_tokens": tokens})
        except ResizeRefused as err:
            event(f"resize refused ({'floor' if 'floor' in str(err) else 'held' if 'hold' in str(err) else 'shrinking'})")
            assert kv.status()["pools"] == before, "a refused resize changed the pools"
            return
        status = kv.status()["pools"][kind]
        assert status["target"] == tokens // p
        if status["pending_release"]:
            event("shrink waits for running requests")
        for pool in kv.status()["pools"].values():
            assert pool["capacity"] == pool["free"] + pool["cached"] + pool["in_use"] + pool["quarantined"], pool

    def teardown(self) -> None:
        if not hasattr(self, "engine"):
            return
        drain(self.engine)
        counts = self.engine.kv.counts
        for name, label in TARGETS.items():
            if counts[name]:
                event(f"reached: {name}")
            target(float(counts[name]), label=label)


# The target phase (hill climbing on the counts above) only on request: see the module docstring.
PHASES = tuple(Phase) if os.environ.get("FT_KV_TARGET") else tuple(p for p in Phase if p != Phase.target)


def _case(name: str, setup: Setup) -> type[unittest.TestCase]:
    machine = type(f"EngineMachine_{name}", (EngineMachine,), {"setup_": setup})
    machine.TestCase.settings = settings(
        settings.get_profile("freetoken-kv"), max_examples=12, stateful_step_count=40, phases=PHASES)
    return machine.TestCase


for _name, _setup in SETUPS.items():
    globals()[f"TestEngineKV_{_name}"] = _case(_name, _setup)
