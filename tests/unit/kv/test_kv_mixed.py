"""The mixed oracle driver (mixed_sim.py): arrivals (pinned, prompt-logprob, drafting or not,
with reasoning budgets, large ones that need the pins released), steps, aborts, forced
eviction, resizes up and down and pin expiry, all in one run of the real engine with drafting
on, over real K/V tensors (float32 and int8), the shadow check after every KV call.

- A fixed seed family runs every time and must reach, over the batch, each mixed situation:
  a shrink that waited for running requests (and completed), a draft rejected after its request
  was preempted, a pinned node skipped by an eviction pass, a starved request that released the
  pins, a resize while requests were drafting (that drafted again after it), and the K/V
  tensors resized under traffic in both dtypes.
- A batch of fresh seeds runs every time (a failure names its seed: KV_SEED=<seed> ... -k
  random_batch replays it).
- A Hypothesis machine drives the same actions (never derandomized; `event()` per situation,
  `target()` towards more of them in the target phase, which needs FT_KV_TARGET=1 as in
  test_kv_state_machine.py). FT_KV_HEAVY=1 runs more examples, longer programs and more seeds.
"""

from __future__ import annotations

import os
import random
from collections import Counter
from collections.abc import Iterator

import pytest
import torch
from hypothesis import Phase, event, settings, strategies as st, target
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

from engine_sim import VOCAB
from mixed_sim import PREFIXES, SETUPS, MixedDriver, MixedSetup, run_mixed

HEAVY = bool(os.environ.get("FT_KV_HEAVY"))
FIXED_SEEDS = range(64 if HEAVY else 12)
RANDOM_BATCH = 16 if HEAVY else 3

MUST_REACH = [
    "shrink waits for running requests",
    "a shrink that waited for running requests completed",
    "draft rejected after a preemption",
    "pinned node skipped by eviction",
    "pins released for a starved request",
    "resize while requests draft",
    "draft by a request that drafted before a resize",
    "int8 K/V tensors shrunk with requests in flight",
    "float K/V tensors shrunk with requests in flight",
    "int8 K/V tensors grown with requests in flight",
    "float K/V tensors grown with requests in flight",
    "rejected draft tokens",
    "pages of rejected tokens released",
    "admission without cache (prompt logprobs)",
    "hit through a tombstone",
    "preemption",
]


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """The driver's tensors are tiny: torch's thread pool only contends on a shared machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_fixed_seed_family_reaches_every_mixed_situation(kv_events: Counter) -> None:
    seen: Counter[str] = Counter()
    checked = 0
    for seed in FIXED_SEEDS:
        driver = run_mixed(seed)
        seen.update(driver.counts)
        checked += driver.checked
    kv_events.update({f"mixed fixed seeds: {k}": v for k, v in seen.items()})
    missing = [name for name in MUST_REACH if not seen[name]]
    assert not missing, f"the mixed seed family no longer reaches: {missing} (saw {dict(seen)})"
    assert checked >= 100, f"only {checked} outputs were compared with the reference"


def test_random_batch(kv_events: Counter) -> None:
    if os.environ.get("KV_SEED"):
        seeds = [int(os.environ["KV_SEED"])]
    else:
        seeds = [random.SystemRandom().randrange(1 << 32) for _ in range(RANDOM_BATCH)]
    for seed in seeds:  # run_mixed's failure names the seed
        kv_events.update({f"mixed random batch: {k}": v for k, v in run_mixed(seed).counts.items()})


class MixedMachine(RuleBasedStateMachine):
    """The mixed driver's actions as Hypothesis rules; the teardown drains and checks idle."""

    @initialize(setup=st.sampled_from(sorted(SETUPS)), cache_dtype=st.sampled_from(["auto", "int8"]),
                max_draft=st.integers(1, 6))
    def start(self, setup: str, cache_dtype: str, max_draft: int) -> None:
        self.driver = MixedDriver(MixedSetup(SETUPS[setup], cache_dtype, max_draft))

    @rule(which=st.integers(0, len(PREFIXES) - 1), share=st.integers(0, 40),
          tail=st.lists(st.integers(0, VOCAB - 1), max_size=8), max_tokens=st.integers(1, 16),
          boundary=st.booleans(), logprobs=st.integers(0, 9), follow=st.booleans(),
          pin=st.one_of(st.none(), st.tuples(st.integers(1, 40), st.sampled_from([5.0, 30.0, 300.0]))),
          draft=st.integers(0, 5), budget=st.one_of(st.none(), st.tuples(st.integers(0, 6), st.integers(0, 2))),
          big=st.integers(0, 15))
    def arrive(self, which, share, tail, max_tokens, boundary, logprobs, follow, pin, draft, budget, big) -> None:
        self.driver.arrive(which, share, tail, max_tokens, boundary=boundary, logprobs=logprobs == 0,
                           follow=follow, pin=pin, draft=draft > 0, budget=budget, big=big == 0)

    @precondition(lambda self: self.driver.engine.has_work())
    @rule(n=st.integers(1, 4))
    def run_steps(self, n: int) -> None:
        self.driver.run_steps(n)

    @precondition(lambda self: self.driver.live)
    @rule(pick=st.integers(0, 1 << 16))
    def abort(self, pick: int) -> None:
        self.driver.abort(pick)

    @rule(swa=st.booleans(), n=st.integers(1, 30))
    def evict(self, swa: bool, n: int) -> None:
        self.driver.evict(swa, n)

    @rule(swa=st.booleans(), share=st.floats(0.25, 1.75))
    def resize(self, swa: bool, share: float) -> None:
        self.driver.resize(swa, share)

    @rule(dt=st.sampled_from([1.0, 10.0, 100.0]))
    def advance_clock(self, dt: float) -> None:
        self.driver.advance_clock(dt)

    def teardown(self) -> None:
        if not hasattr(self, "driver"):
            return
        self.driver.finish()
        counts = self.driver.counts
        for name in MUST_REACH:
            if counts[name]:
                event(f"reached: {name}")
        target(float(sum(1 for name in MUST_REACH if counts[name])), label="mixed situations reached")
        target(float(counts["draft rejected after a preemption"]), label="drafts rejected after a preemption")


# The target phase only on request (see test_kv_state_machine.py: its hill climbing has no budget).
PHASES = tuple(Phase) if os.environ.get("FT_KV_TARGET") else tuple(p for p in Phase if p != Phase.target)
MixedMachine.TestCase.settings = settings(
    settings.get_profile("freetoken-kv"), max_examples=60 if HEAVY else 10,
    stateful_step_count=80 if HEAVY else 40, phases=PHASES)
TestMixedKVMachine = MixedMachine.TestCase
