"""The mixed oracle driver: every KV feature in one run of the real engine, under the content oracle.

One `MixedDriver` drives the real `Engine` / `Scheduler` / `KVManager` with `--speculative ngram`
over a null model (`MixedRunner`: the drafting runner of spec_sim.py) whose K/V memory is real
(`TensorShadow`: a `KVTensors` in float32 or int8 holding, per slot, the id of the prefix its K/V
came from). Its actions, shared by the Hypothesis machine and the seeded programs
(test_kv_mixed.py):

- arrivals over shared prefixes and continued conversations, some pinned (a retention pin at a
  breakpoint), some asking for prompt logprobs (no cache), some drafting and some opted out,
  some with a reasoning budget whose close the engine forces, and large ones that only fit once
  the pins are released (a pin never starves a request);
- steps, aborts, forced eviction passes (SWA or FULL), pool resizes up and down (shrinks below
  what the tree holds and below what running requests hold, which wait for them), and a clock
  the pins expire on.

Checked: after every KV manager call (drafts and accepts included) the shadow check over the
tensors' bytes and the full audit (A6 between steps); after every step, that the tree holds
only real sequences; around every step and eviction pass, that no live pin was evicted; every
request that ran to its length produced exactly the model's greedy continuation with its
budget's forced close; at the end the engine drains, every shrink completed and the pools
balance. `MixedKV.counts` records the situations reached (the must-reach list of the tests).
`oracle=False` keeps only the audit (the engine's, after every step, and A1-A6 after every
call): the negative controls show that each injected bug passes it and fails the driver.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from engine_sim import VOCAB, Setup
from freetoken.config import EngineConfig
from freetoken.engine.engine import Engine, RequestRefused
from freetoken.engine.resize import ResizeRefused
from freetoken.kv.pins import live_pins
from freetoken.kv.tree import Node
from freetoken.reasoning_budget import ReasoningBudget, ReasoningState
from freetoken.request import FinishReason, Request, SamplingParams
from shadow import ShadowViolation
from spec_sim import DraftingRunner, SpecKV, Watch, next_token
from tensor_shadow import TensorShadow

# Prompts share heads; LOOP repeats, so n-gram drafts find matches in the prompt as well.
LONG = [1 + (i * 29) % (VOCAB - 1) for i in range(40)]
LOOP = [3, 9, 27, 81, 5, 3, 9, 27, 81, 5, 3, 9, 27, 81, 5, 3, 9, 27]
PREFIXES = [LONG, LONG[:6] + [90 + i for i in range(20)], [7] * 14, LOOP]
END_IDS = [(100, 101), (4, 5), (120,)]  # reasoning close markers (4, 5 are tokens next_token makes)

DRAIN_STEPS = 1000  # a request never waits this long unless something starves it

# SWA pools above their floors (24, 22 and 12 pages), so that an SWA shrink can wait too.
SETUPS = {
    "p1_w5": Setup(1, 5, 48, swa_pages=40),
    "p2_w7": Setup(2, 7, 28, swa_pages=36, max_running=4, chunk=10),
    "p4_w6": Setup(4, 6, 16, swa_pages=20),
    "p4_full_only": Setup(4, None, 16),
}


@dataclass(frozen=True)
class MixedSetup:
    setup: Setup
    cache_dtype: str = "auto"  # the K/V memory: "auto" (float32) or "int8"
    max_draft: int = 4


def reference(prompt: list[int], max_tokens: int, budget: ReasoningBudget | None) -> list[int]:
    """The null model's greedy continuation, with the budget's close forced where it is due."""
    tokens = list(prompt)
    state = ReasoningState(budget) if budget is not None else None
    for _ in range(max_tokens):
        forced = state.forced() if state is not None else None
        tok = next_token(tokens) if forced is None else forced
        tokens.append(tok)
        if state is not None:
            state.advance(tok)
    return tokens[len(prompt):]


class MixedKV(SpecKV):
    """`SpecKV` over real K/V tensors, counting the mixed situations the tests must reach."""

    def __init__(self, cache_dtype: str = "auto", **kwargs: object) -> None:
        super().__init__(**kwargs)
        self.shadow = TensorShadow(self.page_size, self.window, self.full_pool.capacity,
                                   self.swa_pool.capacity if self.swa_pool else None, cache_dtype)
        self.preempted: set[str] = set()
        self.drafting_at_resize: set[str] = set()
        self.waiting_shrinks: set[str] = set()
        if self.tree is not None:
            self.tree.evict_full = self._pin_watched(self.tree.evict_full)  # type: ignore[method-assign]

    def release(self, rid: str, *, preempted: bool = False) -> None:
        if preempted and rid in self._requests:
            self.preempted.add(rid)
        super().release(rid, preempted=preempted)

    def accept(self, rid: str, written: int) -> int:
        rejected = self.shadow.requests[rid].valid - 1 > written
        released = super().accept(rid, written)
        if rejected and rid in self.preempted:
            self.counts["draft rejected after a preemption"] += 1
        return released

    def extend_draft(self, rid: str, num_tokens: int) -> bool:
        ok = super().extend_draft(rid, num_tokens)
        if ok and rid in self.drafting_at_resize:
            self.drafting_at_resize.discard(rid)
            self.counts["draft by a request that drafted before a resize"] += 1
        return ok

    def release_pins(self) -> bool:
        released = super().release_pins()
        if released:
            self.counts["pins released for a starved request"] += 1
        self.verify(f"release_pins() -> {released}")
        return released

    def resize(self, kind: str, pages: int) -> int:
        drafting = {rid for rid, t in self._requests.items() if t.drafted}
        if drafting:
            self.counts["resize while requests draft"] += 1
            self.drafting_at_resize |= drafting
        pending = super().resize(kind, pages)
        if pending:
            self.waiting_shrinks.add(kind)
        return pending

    def finish_shrinks(self) -> list[str]:
        done = super().finish_shrinks()
        for kind in done:
            if kind in self.waiting_shrinks:
                self.waiting_shrinks.discard(kind)
                self.counts["a shrink that waited for running requests completed"] += 1
        return done

    def _pin_watched(self, evict: Callable[[int], int]) -> Callable[[int], int]:
        """Count a FULL pass that left a pinned leaf it would have taken without the pin: it
        ran out of other candidates, or took an unpinned leaf used more recently."""

        def watched(need: int) -> int:
            tree = self.tree
            assert tree is not None
            now, rc = tree.clock(), self.full_pool.rc
            leaves = [n for n in tree.nodes() if not n.children]
            pinned = [n for n in leaves if n.pin_until > now and rc[n.full[-1]] == 1]
            others = {n: (n.npages, n.last_access) for n in leaves if n.pin_until <= now}
            freed = evict(need)
            kept = [n for n in pinned if n.parent is not None]
            if kept:
                trimmed = [t for n, (k, t) in others.items() if n.parent is None or n.npages < k]
                oldest = min(n.last_access for n in kept)
                if freed < need or any(t > oldest for t in trimmed):
                    self.counts["pinned node skipped by eviction"] += 1
            return freed

        return watched


class MixedRunner(DraftingRunner):
    """The drafting null runner whose K/V memory is the shadow's `KVTensors`."""

    def resize_kv(self, kind: str, pages: int) -> None:
        before = self.kv.tensor_pages[kind]
        self.kv.tensor_pages[kind] = pages
        shadow: TensorShadow = self.kv.shadow  # type: ignore[assignment]
        shadow.resize(kind, pages)
        if self.kv.request_ids:
            dtype = "int8" if shadow.tensors.quantized else "float"
            self.kv.counts[f"{dtype} K/V tensors {'grown' if pages > before else 'shrunk'} with requests in flight"] += 1
        self.kv.verify(f"tensor resize({kind}, {pages})")  # every holder still reads its own K/V


def make_mixed_engine(mixed: MixedSetup, clock: Callable[[], float]) -> Engine:
    setup = mixed.setup
    p = setup.page_size
    swa_tokens: int | str | None = None
    if setup.window is not None:
        swa_tokens = "floor" if setup.swa_pages is None else setup.swa_pages * p
    config = EngineConfig(
        model="null", page_size=p, max_running_requests=setup.max_running, max_prefill_length=setup.chunk,
        num_tokens=setup.full_pages * p, cache_type=setup.cache_type, debug_kv=True, swa_pool_tokens=swa_tokens,
        speculative="ngram", spec_max_draft=mixed.max_draft, spec_ngram_min=1, spec_ngram_max=3,
    )
    resolved = config.resolve(model_context_length=4096, window=setup.window, kv_bytes_per_token=1,
                              available_bytes=1 << 30)
    kv = MixedKV(cache_dtype=mixed.cache_dtype, full_pages=resolved.full_pages, swa_pages=resolved.swa_pages,
                 page_size=p, window=setup.window, cache_type=resolved.cache_type, clock=clock)
    return Engine(resolved, MixedRunner(kv), kv, None)


class MixedDriver:
    """The actions of a mixed run and the checks around them (see the module docstring)."""

    def __init__(self, mixed: MixedSetup, oracle: bool = True) -> None:
        self.mixed = mixed
        self.oracle = oracle
        self.now = 0.0
        self.engine = make_mixed_engine(mixed, clock=lambda: self.now)
        self.kv: MixedKV = self.engine.kv  # type: ignore[assignment]
        self.kv.shadow.enabled = oracle
        self.watch = Watch(self.engine)
        if oracle:
            sched = self.engine.scheduler
            sched.schedule, sched.preempt = self._no_starvation(sched.schedule, sched.preempt)  # type: ignore[method-assign]
        else:  # the audit alone
            self.watch.check_tree = lambda: None  # type: ignore[method-assign]
        self.live: dict[str, Request] = {}
        self.finished: list[list[int]] = []
        self.serial = 0
        self.pinned: list[Node] = []
        self.checked = 0  # requests whose output was compared with the reference

    @property
    def counts(self) -> Counter[str]:
        return self.kv.counts

    # -- actions ------------------------------------------------------------------------------

    def arrive(self, which: int, share: int, tail: list[int], max_tokens: int, *, boundary: bool = False,
               logprobs: bool = False, follow: bool = False, pin: tuple[int, float] | None = None,
               draft: bool = True, budget: tuple[int, int] | None = None, big: bool = False) -> None:
        """One arrival; `budget` = (reasoning tokens, which END_IDS); `big`: a prompt of most of
        the pool (it fits only with the pins released)."""
        cap = self.engine.kv.capacity("full") * self.mixed.setup.page_size
        if big:
            n = max(2, int(cap * 0.8) - max_tokens)
            prompt = (PREFIXES[which % len(PREFIXES)] * (n // 10 + 2))[:n]
            bounds: tuple[int, ...] = ()
        elif follow and self.finished:
            base = self.finished[share % len(self.finished)]
            prompt, bounds = base + tail[:3] + [5], (len(base),)
        else:
            prompt = PREFIXES[which % len(PREFIXES)][:share] + tail or [1]
            bounds = (share,) if boundary and 0 < share < len(prompt) else ()
        if not big and len(prompt) + max_tokens > cap // 2:
            return
        self.serial += 1
        rid = f"r{self.serial}"
        pins = ((min(pin[0], len(prompt)), pin[1]),) if pin is not None else ()
        marks = tuple(sorted(set(bounds) | {int(end) for end, _ in pins}))
        reasoning = None if budget is None else ReasoningBudget(budget[0], end_ids=END_IDS[budget[1] % len(END_IDS)])
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                                prompt_logprobs=0 if logprobs else None, speculative=draft,
                                reasoning_budget=reasoning)
        req = Request(rid, list(prompt), params, boundaries=marks, pins=pins)
        try:
            self.engine.add_request(req)
        except RequestRefused:  # past a pool shrunk below it
            self.counts["arrival refused (past the pool)"] += 1
            return
        self.live[rid] = req
        self.watch.track([req])
        if big:
            self.counts["large arrival"] += 1

    def run_steps(self, n: int) -> None:
        for _ in range(n):
            if not self.engine.has_work():
                break
            self._snapshot_pins()
            self.watch.step()
            self._check_pins()
        self._collect()

    def abort(self, pick: int) -> None:
        if not self.live:
            return
        self.engine.abort(sorted(self.live)[pick % len(self.live)])
        self.watch.step()
        self._collect()

    def evict(self, swa: bool, n: int) -> None:
        kv = self.kv
        if kv.tree is None:
            return
        self._snapshot_pins()
        kv.evict("swa" if swa and kv.swa_pool is not None else "full", n)
        self._check_pins()

    def advance_clock(self, dt: float) -> None:
        self.now += dt

    def resize(self, swa: bool, share: float) -> None:
        """Resize a pool to a share of its start-up size; a refusal must change nothing."""
        kv, p = self.kv, self.mixed.setup.page_size
        kind = "swa" if swa and kv.swa_pool is not None else "full"
        start = self.engine.config.swa_pages if kind == "swa" else self.engine.config.full_pages
        tokens = max(1, int((start or 1) * share)) * p
        before = kv.status()["pools"]
        try:
            self.engine.resize(**{f"{kind}_tokens": tokens})
        except ResizeRefused:
            self.counts["resize refused"] += 1
            assert kv.status()["pools"] == before, "a refused resize changed the pools"
            return
        assert kv.status()["pools"][kind]["target"] == tokens // p
        for pool in kv.status()["pools"].values():
            assert pool["capacity"] == pool["free"] + pool["cached"] + pool["in_use"] + pool["quarantined"], pool

    def finish(self) -> None:
        """Drain, then the idle checks: no shrink pending, pools balanced, outputs exact."""
        for _ in range(DRAIN_STEPS):
            if not self.engine.has_work():
                break
            self.run_steps(1)
        self._collect()
        if not self.oracle:  # the audit alone: whatever state the run ended in, audit it
            report = self.kv.audit(idle=not self.kv.request_ids)
            assert report.ok, str(report)
            return
        assert not self.engine.has_work(), f"the engine did not drain in {DRAIN_STEPS} steps"
        assert not self.kv.shrinking(), "a shrink is still pending with no request holding pages"
        self.kv.verify("drain (idle)")
        report = self.kv.audit(idle=True)
        assert report.ok, str(report)
        shadow: TensorShadow = self.kv.shadow  # type: ignore[assignment]
        assert shadow.null_page_is_zero(), "page 0 of the K/V memory was written"

    # -- checks -------------------------------------------------------------------------------

    def _collect(self) -> None:
        for rid in [r for r, q in self.live.items() if q.finished]:
            req = self.live.pop(rid)
            if req.output_ids:
                self.finished.append(req.all_ids[:-1])
            if self.oracle and req.finish_reason is FinishReason.LENGTH:
                want = reference(req.prompt_ids, req.params.max_tokens, req.params.reasoning_budget)
                assert req.output_ids == want, (
                    f"{rid}: output {req.output_ids} is not the model's greedy continuation {want} "
                    f"(drafted {req.report.drafted_tokens}, preempted {req.preemptions})")
                self.checked += 1

    def _no_starvation(self, schedule: Callable[[], list], preempt: Callable[[Request], None],
                       ) -> tuple[Callable[[], list], Callable[[Request], None]]:
        """A pin never starves a request: a step that runs nothing while requests wait, and a
        request preempting itself as the only one running, leave no live pin (the scheduler
        releases them all first)."""
        sched = self.engine.scheduler

        def pinned() -> int:
            tree = self.kv.tree
            return 0 if tree is None else len(live_pins(tree))

        def checked_schedule() -> list:
            items = schedule()
            if not items and sched.waiting and not sched.running and pinned():
                raise AssertionError(f"pins starve {sched.waiting[0].rid}: nothing runs, it waits, "
                                     f"{pinned()} nodes are still pinned")
            return items

        def checked_preempt(req: Request) -> None:
            if sched.running == [req] and pinned():
                raise AssertionError(f"pins starve {req.rid}: it preempts itself, alone, with "
                                     f"{pinned()} nodes still pinned")
            preempt(req)

        return checked_schedule, checked_preempt

    def _snapshot_pins(self) -> None:
        tree = self.kv.tree
        self.pinned = [] if tree is None or not self.oracle else live_pins(tree)

    def _check_pins(self) -> None:
        gone = [n for n in self.pinned if n.parent is None and n.pin_until > self.now]
        assert not gone, f"eviction removed {len(gone)} pinned nodes"


def mixed_program(seed: int) -> tuple[MixedSetup, Callable[[MixedDriver], None]]:
    """A setup and a program over it, both from `seed` alone."""
    rng = random.Random(seed)
    mixed = MixedSetup(rng.choice(list(SETUPS.values())), rng.choice(["auto", "int8"]), rng.randint(1, 6))

    def program(d: MixedDriver) -> None:
        for _ in range(rng.randint(50, 90)):
            act = rng.random()
            if act < 0.30:
                for _ in range(rng.choice([1, 1, 2, 3])):
                    d.arrive(
                        rng.randrange(len(PREFIXES)), rng.randint(0, 40),
                        [rng.randrange(VOCAB) for _ in range(rng.randint(0, 8))], rng.randint(1, 16),
                        boundary=rng.random() < 0.3, logprobs=rng.random() < 0.07, follow=rng.random() < 0.15,
                        pin=(rng.randint(1, 40), rng.choice([5.0, 30.0, 300.0])) if rng.random() < 0.3 else None,
                        draft=rng.random() < 0.85,
                        budget=(rng.randint(0, 6), rng.randrange(3)) if rng.random() < 0.3 else None,
                        big=rng.random() < 0.04,
                    )
            elif act < 0.33:  # a pinned prefix, then a request that needs most of the pool
                which = rng.randrange(len(PREFIXES))
                d.arrive(which, 40, [], rng.randint(1, 4), pin=(40, 300.0))
                d.run_steps(rng.randint(2, 8))
                d.arrive(which + 1, 0, [], rng.randint(1, 8), big=True, draft=rng.random() < 0.5)
            elif act < 0.70:
                d.run_steps(rng.randint(1, 4))
            elif act < 0.76:
                d.abort(rng.randrange(1 << 16))
                d.run_steps(1)
            elif act < 0.84:
                d.evict(rng.random() < 0.6, rng.randint(1, 30))
            elif act < 0.94:
                d.resize(rng.random() < 0.4, rng.uniform(0.25, 1.75))
            else:
                d.advance_clock(rng.choice([1.0, 10.0, 100.0]))
        d.finish()

    return mixed, program


def run_mixed(seed: int, oracle: bool = True) -> MixedDriver:
    """Play the program of `seed`; a failure is re-raised naming the seed."""
    mixed, program = mixed_program(seed)
    driver = MixedDriver(mixed, oracle=oracle)
    try:
        program(driver)
    except (ShadowViolation, AssertionError, Exception) as err:
        raise AssertionError(
            f"mixed KV program seed={seed} ({mixed}) failed; reproduce with "
            f"KV_SEED={seed} python -m pytest -q tests/unit/kv/test_kv_mixed.py -k random_batch\n"
            f"{type(err).__name__}: {err}") from err
    return driver

