"""The engine itself over a null model, for the KV tests.

`make_engine` builds the real `Engine` (its `Scheduler`: one shared prefill budget per step,
running requests first, admission in order, preemption of the youngest, and its commit points:
prefill chunks that do not sample, finish, abort, preempt) over a `CheckedKV` and a
`NullRunner`. The runner computes nothing: it tells the shadow model which slots the forward
writes, checks every key the chunk's queries read, and returns one-hot logits whose token is a
function of the prefix id at the query, so equal prefixes continue equally (as a greedy model
does) and conversations can be continued from the tree.

`random_program(seed)` is a seeded generator of traffic over shared prefixes (long prompts of
several windows, short prompts sharing their first tokens, follow-ups of finished
conversations, prompt-logprob requests, aborts, forced eviction passes; on hybrid setups also
state pool resizes) on small pools, and
`run_program` plays it; a failure names the seed.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from freetoken.config import EngineConfig
from freetoken.engine.engine import Engine
from freetoken.engine.resize import ResizeRefused
from freetoken.engine.scheduler import ScheduledItem
from freetoken.request import Request, SamplingParams
from shadow import CheckedKV, ShadowViolation

VOCAB = 128


class NullRunner:
    """The engine's Runner interface without a model: shadow writes + reads, one-hot logits."""

    vocab_size = VOCAB
    resizable = True
    model = torch.nn.Module()  # no experts: the engine finds no expert cache to resize

    def __init__(self, kv: CheckedKV) -> None:
        self.kv = kv

    def resize_kv(self, kind: str, pages: int) -> None:
        """No tensors to reallocate; the pool must already allow what the tensors would hold."""
        self.kv.resized_tensors(kind, pages)

    def forward(self, items: list[ScheduledItem]) -> torch.Tensor:
        rows: list[int] = []
        for item in items:
            req = item.req
            tokens = req.token_slice(0, item.start + item.n)
            self.kv.forward(req.rid, tokens, item.start, item.n, item.state_slot)
            ids = self.kv.shadow.requests[req.rid].ids
            if item.all_logits:
                rows.extend(ids[item.start : item.start + item.n])
            elif item.samples:
                rows.append(ids[item.start + item.n - 1])
        logits = torch.zeros(len(rows), VOCAB)
        for r, pid in enumerate(rows):
            logits[r, (pid * 2654435761) % VOCAB] = 1.0
        return logits


@dataclass(frozen=True)
class Setup:
    page_size: int
    window: int | None
    full_pages: int
    swa_pages: int | None = None  # None: the floor (plus nothing)
    max_running: int = 3
    chunk: int = 8
    cache_type: str = "radix"
    state_slots: int | None = None  # a hybrid model's state pool (linear-attention layers)


def make_engine(setup: Setup, kv_class: type[CheckedKV] = CheckedKV, debug_kv: bool = True,
                clock: Callable[[], float] = time.monotonic) -> Engine:
    """`debug_kv`: the engine's own audit after every step, fatal (as in all engine tests);
    `clock`: the retention pins' clock."""
    p = setup.page_size
    swa_tokens: int | str | None = None
    if setup.window is not None:
        swa_tokens = "floor" if setup.swa_pages is None else setup.swa_pages * p
    config = EngineConfig(
        model="null", page_size=p, max_running_requests=setup.max_running,
        max_prefill_length=setup.chunk, num_tokens=setup.full_pages * p,
        cache_type=setup.cache_type, debug_kv=debug_kv, swa_pool_tokens=swa_tokens,
    )
    resolved = config.resolve(model_context_length=4096, window=setup.window,
                              kv_bytes_per_token=1, available_bytes=1 << 30)
    kv = kv_class(full_pages=resolved.full_pages, swa_pages=resolved.swa_pages, page_size=p,
                  window=setup.window, cache_type=resolved.cache_type, clock=clock,
                  state_slots=setup.state_slots, snapshot_interval=16 if setup.state_slots else 0)
    return Engine(resolved, NullRunner(kv), kv, None)


def submit(engine: Engine, rid: str, prompt: list[int], max_tokens: int,
           boundaries: tuple[int, ...] = (), prompt_logprobs: int | None = None,
           pins: tuple[tuple[int, float], ...] = ()) -> Request:
    """A greedy request; a pin's position is also a boundary, as the server marks it."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                            prompt_logprobs=prompt_logprobs)
    marks = tuple(sorted(set(boundaries) | {int(end) for end, _ in pins}))
    req = Request(rid, list(prompt), params, boundaries=marks, pins=pins)
    engine.add_request(req)
    return req


def step(engine: Engine) -> None:
    engine.step()
    engine.kv.end_step()  # type: ignore[attr-defined]


def drain(engine: Engine, limit: int = 10_000) -> None:
    """Step until idle, then the idle audit (A5) and the shadow check."""
    for _ in range(limit):
        if not engine.has_work():
            break
        step(engine)
    assert not engine.has_work(), "the engine did not drain"
    kv: CheckedKV = engine.kv  # type: ignore[assignment]
    assert not kv.shrinking(), "a shrink is still pending with no request holding pages"
    kv.verify("drain (idle)")
    report = kv.audit(idle=True)
    assert report.ok, str(report)


# -- seeded traffic ---------------------------------------------------------------------------

SETUPS = [
    Setup(1, 5, 64), Setup(1, 12, 64, swa_pages=48), Setup(4, 3, 24), Setup(4, 6, 24),
    Setup(4, 13, 24, chunk=12), Setup(4, None, 24), Setup(1, 5, 64, cache_type="naive"),
    Setup(2, 7, 40, max_running=4, chunk=10),
]


@dataclass
class Traffic:
    """The state a program generator keeps: prefixes and finished sequences to continue."""

    rng: random.Random
    prefixes: list[list[int]]
    finished: list[list[int]] = field(default_factory=list)
    serial: int = 0

    def prompt(self) -> tuple[list[int], tuple[int, ...]]:
        r = self.rng
        kind = r.random()
        if kind < 0.15 and self.finished:  # a conversation goes on: its sequence + a new turn
            base = list(r.choice(self.finished))
            cut = len(base) - r.randint(0, 2)
            return base[:cut] + [r.randrange(VOCAB) for _ in range(r.randint(1, 4))], (cut,)
        prefix = r.choice(self.prefixes)
        share = r.choice([r.randint(1, 8), r.randint(0, len(prefix)), len(prefix)])
        tail = [r.randrange(VOCAB) for _ in range(r.randint(0 if share else 1, 10))]
        bounds = (share,) if share and tail and r.random() < 0.3 else ()
        return prefix[:share] + tail, bounds


# Hybrid models: no window, a state pool of R + 2 slots (every snapshot evicted for the next
# request's slot) or with room for snapshots.
HYBRID_SETUPS = [
    Setup(4, None, 24, state_slots=5), Setup(4, None, 32, chunk=12, state_slots=9),
    Setup(2, None, 40, max_running=4, chunk=10, state_slots=8),
]


def random_program(seed: int, setups: list[Setup] = SETUPS) -> tuple[Setup, Callable[[Engine], None]]:
    """A setup and a program over it, both from `seed` alone."""
    rng = random.Random(seed)
    setup = rng.choice(setups)

    def program(engine: Engine) -> None:
        long = [rng.randrange(VOCAB) for _ in range(rng.randint(20, 44))]
        traffic = Traffic(rng, [long, long[:6] + [rng.randrange(VOCAB) for _ in range(20)],
                                [rng.randrange(VOCAB) for _ in range(12)]])
        live: dict[str, Request] = {}
        cap = engine.config.full_pages * setup.page_size
        for _ in range(rng.randint(40, 90)):
            act = rng.random()
            if act < 0.35:  # a burst of arrivals
                for _ in range(rng.choice([1, 1, 2, 3])):
                    prompt, bounds = traffic.prompt()
                    max_tokens = rng.choice([1, 2, 3, rng.randint(1, 20)])
                    if len(prompt) + max_tokens > cap // 2:
                        continue
                    traffic.serial += 1
                    rid = f"r{traffic.serial}"
                    logprobs = 0 if rng.random() < 0.05 else None
                    live[rid] = submit(engine, rid, prompt, max_tokens, bounds, logprobs)
            elif act < 0.85:
                for _ in range(rng.randint(1, 3)):
                    step(engine)
            elif act < 0.93 and live:
                engine.abort(rng.choice(sorted(live)))
                step(engine)
            elif engine.kv.state_pool is not None and rng.random() < 0.5:  # hybrids: a state pool resize
                slots = engine.kv.state_pool.capacity
                try:
                    engine.resize(state_slots=rng.randint(setup.max_running + 2, slots + 4))
                except ResizeRefused:
                    engine.kv.counts["state resize refused"] += 1  # type: ignore[attr-defined]
            elif engine.kv.tree is not None:
                kind = "swa" if engine.kv.swa_pool is not None and rng.random() < 0.6 else "full"
                engine.kv.evict(kind, rng.randint(1, 30))
            for rid in [r for r, q in live.items() if q.finished]:
                req = live.pop(rid)
                if req.output_ids:
                    traffic.finished.append(req.all_ids[:-1])
        drain(engine)

    return setup, program


def run_program(seed: int, kv_class: type[CheckedKV] = CheckedKV, setups: list[Setup] = SETUPS) -> CheckedKV:
    """Play the program of `seed`; any failure is re-raised naming the seed."""
    setup, program = random_program(seed, setups)
    engine = make_engine(setup, kv_class)
    try:
        program(engine)
    except (ShadowViolation, AssertionError, Exception) as err:
        raise AssertionError(
            f"KV program seed={seed} ({setup}) failed; reproduce with "
            f"KV_SEED={seed} python -m pytest -q tests/unit/kv/test_kv_programs.py -k random_batch\n"
            f"{type(err).__name__}: {err}") from err
    return engine.kv  # type: ignore[return-value]
