"""Seeded traffic on a hybrid model's KV (a state pool, no window) through the real engine over
a null model (engine_sim.random_program over HYBRID_SETUPS): every KV call is audited, state
slots included, and the shadow checks state contents too: a chunk starts from the state of its
own prefix (zero at position 0), every request's slot holds the state of its written tokens,
and every tree snapshot the state of its own path at its end, through state pool resizes too
(a shrink moves the snapshots it keeps). The negative controls break one
copy each and the shadow must catch it."""

from __future__ import annotations

from collections import Counter

import pytest

from engine_sim import HYBRID_SETUPS, run_program
from shadow import CheckedKV

SEEDS = range(10)


def test_hybrid_programs_hit_through_snapshots_and_stay_consistent(kv_events: Counter) -> None:
    seen: Counter[str] = Counter()
    for seed in SEEDS:
        kv = run_program(seed, setups=HYBRID_SETUPS)
        seen.update(kv.counts)
        assert kv.state_pool.num_free + kv.tree.num_pages("state") == kv.state_pool.capacity
    kv_events.update({f"hybrid seeds: {k}": v for k, v in seen.items()})
    assert seen["hit"] > 0 and seen["preemption"] > 0, dict(seen)
    assert seen["state grow"] > 0 and seen["state shrink"] > 0 and seen["shrink waits for running requests"] > 0, dict(seen)


class NoCopyOnHit(CheckedKV):
    """A hit takes its slot but the snapshot is never copied into it."""

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)
        real = self.copy_state
        self.copy_state = lambda src, dst: real(src, dst) if dst in self.tree.owned("state") else None


class NoCopyOnCommit(CheckedKV):
    """A snapshot takes the tree's slot but the request's state is never copied into it."""

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)
        real = self.copy_state
        self.copy_state = lambda src, dst: None if dst in self.tree.owned("state") else real(src, dst)


@pytest.mark.parametrize(
    ("broken", "caught"),
    [(NoCopyOnHit, r"request r\d+: state slot \d+ holds the state of prefix"),
     (NoCopyOnCommit, r"snapshot slot \d+ holds the state of prefix")],
)
def test_the_shadow_catches_a_missing_state_copy(broken: type[CheckedKV], caught: str) -> None:
    with pytest.raises(AssertionError, match=caught):
        for seed in SEEDS:
            run_program(seed, kv_class=broken, setups=HYBRID_SETUPS)
