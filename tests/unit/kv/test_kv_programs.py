"""Seeded traffic through the real engine over a null model, every KV call shadow-checked and
audited (engine_sim.random_program). A fixed seed set runs every time and must reach each
dangerous situation at least once; a bounded batch of fresh random seeds runs too, and a
failure names its seed (replay: KV_SEED=<seed> ... -k random_batch)."""

from __future__ import annotations

import os
import random
from collections import Counter

from engine_sim import run_program

FIXED_SEEDS = range(24)
RANDOM_BATCH = 8

# Each must occur somewhere in the fixed seed set, or the programs no longer test it.
MUST_OCCUR = [
    "hit through a tombstone",
    "heal",
    "preemption",
    "swa eviction under a request-held path",
    "full eviction under a request-held path",
    "commit beneath a tombstone another request holds",
    "seed: B commits beneath a tombstone A holds, decodes 2+ beside A, ends",
    "same step: B matched, A commits, B commits",
    "admission without cache (prompt logprobs)",
    "extend refused (pool short)",
]


def test_fixed_seed_set(kv_events: Counter) -> None:
    seen: Counter[str] = Counter()
    for seed in FIXED_SEEDS:
        seen.update(run_program(seed).counts)
    kv_events.update({f"fixed seeds: {k}": v for k, v in seen.items()})
    missing = [name for name in MUST_OCCUR if not seen[name]]
    assert not missing, f"the fixed seeds no longer reach: {missing} (saw {dict(seen)})"


def test_random_batch(kv_events: Counter) -> None:
    if os.environ.get("KV_SEED"):
        seeds = [int(os.environ["KV_SEED"])]
    else:
        seeds = [random.SystemRandom().randrange(1 << 32) for _ in range(RANDOM_BATCH)]
    for seed in seeds:  # run_program's failure names the seed
        kv_events.update({f"random batch: {k}": v for k, v in run_program(seed).counts.items()})
