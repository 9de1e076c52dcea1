"""Prefix-cache hit rate of an agent workload with and without retention pins, at a pool small
enough to evict (docs/kv-cache.md, "Retention pins"). No model: the real Engine, Scheduler and
KVManager over the null runner of the KV tests (tests/unit/kv/engine_sim.py), so the figure is
the cache's alone and the run takes seconds on one core.

Workload: 6 agents, each with its own 32-token system prompt (its tools and instructions); each
runs 8 turns, a turn appending 16 user tokens and its 8 output tokens to its conversation; the
agents take turns round-robin, one request at a time, and after every agent request a batch job
sends two fresh 160-token prompts (unrelated traffic that evicts). Pools: 128 FULL and 48 SWA pages of 4 tokens, window 7;
the pin caps are the default quarter of each (32 FULL pages: 4 of the 6 system prompts; 12 SWA
pages), so two agents' pins are refused (counted) and they are served unpinned. With pins, every agent request pins its system prompt (the
`cache_control` breakpoint on the system block) for 300 s. Prints the hit rates.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "tests" / "unit" / "kv")]

from engine_sim import Setup, drain, make_engine, submit  # noqa: E402

SYSTEM, TURNS, AGENTS, USER, OUTPUT, JOB, JOBS = 32, 8, 6, 16, 8, 160, 2


def run(pins: bool, seed: int = 0) -> tuple[float, float]:
    """(hit rate over every agent prompt token, share of agent requests whose system prompt hit)."""
    rng = random.Random(seed)
    engine = make_engine(Setup(4, 7, 128, swa_pages=48, max_running=3, chunk=32))
    convs = [[rng.randrange(1, 128) for _ in range(SYSTEM)] for _ in range(AGENTS)]
    prompt_tokens = cached = system_hits = requests = 0
    serial = 0
    for turn in range(TURNS):
        for a in range(AGENTS):
            convs[a] += [rng.randrange(1, 128) for _ in range(USER)]
            serial += 1
            req = submit(engine, f"a{serial}", convs[a], OUTPUT, boundaries=(SYSTEM, len(convs[a])),
                         pins=((SYSTEM, 300.0),) if pins else ())
            drain(engine)
            convs[a] = req.all_ids[:-1]  # what the next turn sends back (the last token's K/V was never written)
            prompt_tokens += len(req.prompt_ids)
            cached += req.report.cached_tokens
            system_hits += req.report.cached_tokens >= SYSTEM
            requests += 1
            for _ in range(JOBS):
                serial += 1
                submit(engine, f"job{serial}", [rng.randrange(1, 128) for _ in range(JOB)], 4)
            drain(engine)
    kv = engine.kv
    print(f"  pins: {kv.status()['pins']}")
    return cached / prompt_tokens, system_hits / requests


if __name__ == "__main__":
    for pins in (False, True):
        rate, sys_rate = run(pins)
        print(f"pins={'on ' if pins else 'off'}  hit rate {rate:.1%} of agent prompt tokens; system prompt hit on {sys_rate:.0%} of agent requests")
