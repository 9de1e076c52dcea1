"""Randomized engine runs under debug_kv: the audit runs after every step and is fatal."""

from __future__ import annotations

import random

import pytest

from freetoken.config import EngineConfig
from freetoken.engine.build import build_engine_for
from freetoken.errors import ConfigError
from freetoken.request import FinishReason, Request, SamplingParams


def run_random_traffic(engine, seed: int, n_requests: int = 56, burst: bool = False) -> tuple[dict[str, Request], set[str]]:
    """Add requests in waves, or all at once (`burst`: every one in flight together), with shared
    heads and long prompts; abort some at random steps."""
    rng = random.Random(seed)
    heads = [[rng.randrange(3, 320) for _ in range(rng.randrange(5, 40))] for _ in range(4)]
    reqs: dict[str, Request] = {}
    aborted: set[str] = set()
    pending = list(range(n_requests))
    steps = 0
    while pending or engine.has_work():
        for _ in range(n_requests if burst else rng.randrange(0, 6)):
            if not pending:
                break
            i = pending.pop(0)
            head = heads[i % 4][: rng.randrange(0, 41)] if i % 3 else []
            prompt = head + [rng.randrange(3, 320) for _ in range(rng.randrange(1, 30))]
            params = SamplingParams(
                max_tokens=rng.randrange(1, 20), temperature=rng.choice([0.0, 0.8]), seed=i, ignore_eos=True
            )
            req = Request(f"r{i}", prompt, params)
            engine.add_request(req)
            reqs[req.rid] = req
        for upd in engine.step():
            assert upd.finish_reason is not FinishReason.ERROR, upd.error
        steps += 1
        live = [rid for rid, r in reqs.items() if not r.finished]
        if live and rng.random() < 0.08:
            rid = rng.choice(live)
            engine.abort(rid)
            aborted.add(rid)
        assert steps < 5000, "the engine stopped making progress"
    return reqs, aborted


@pytest.mark.parametrize("seed,burst", [(0, False), (1, False), (2, True)])
def test_random_concurrent_traffic_with_preemption(tiny_gemma, seed, burst):
    # A small FULL pool forces preemption; the SWA pool sits exactly at its floor.
    config = EngineConfig(
        model="tiny", dtype="float64", page_size=4, num_tokens=4 * 40, max_running_requests=6,
        max_prefill_length=12, swa_pool_tokens="floor", debug_kv=True,
    )
    engine = build_engine_for(config, tiny_gemma)
    assert engine.kv.swa_pool.capacity == engine.config.swa_floor
    reqs, aborted = run_random_traffic(engine, seed, burst=burst)
    assert len(reqs) >= 50
    for rid, req in reqs.items():
        assert req.finished
        if rid not in aborted:
            assert req.finish_reason is FinishReason.LENGTH
            assert len(req.output_ids) == req.params.max_tokens
    assert engine.scheduler.preemptions > 0, "the pool was meant to force preemption"
    status = engine.status()
    for pool in status["pools"].values():
        assert pool["in_use"] == 0
        assert pool["free"] + pool["cached"] == pool["capacity"]
    assert status["integrity"]["violations"] == 0


def test_preempted_greedy_requests_give_the_same_tokens(tiny_gemma):
    """Recomputing after preemption (with prefix hits) must not change greedy outputs."""
    rng = random.Random(7)
    ps = [[rng.randrange(3, 320) for _ in range(rng.randrange(10, 30))] for _ in range(8)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    outs = {}
    for pages in (400, 36):
        config = EngineConfig(model="tiny", dtype="float64", page_size=4, num_tokens=4 * pages,
                              max_running_requests=8, max_prefill_length=16, debug_kv=True)
        engine = build_engine_for(config, tiny_gemma)
        reqs = [Request(f"q{i}", p, params) for i, p in enumerate(ps)]
        for r in reqs:
            engine.add_request(r)
        while engine.has_work():
            engine.step()
        outs[pages] = [r.output_ids for r in reqs]
        if pages == 36:
            assert engine.scheduler.preemptions > 0
    assert outs[400] == outs[36]


def test_swa_pool_below_floor_is_refused(tiny_gemma):
    config = EngineConfig(model="tiny", dtype="float64", page_size=4, num_tokens=400, max_running_requests=4,
                          max_prefill_length=16, swa_pool_tokens=20)
    with pytest.raises(ConfigError) as err:
        build_engine_for(config, tiny_gemma)
    msg = str(err.value)
    # floor = 4 * (ceil(6 / 4) + 1) + ceil(16 / 4) + 1 = 17 pages
    assert "floor of 17 pages" in msg and "--swa-pool-tokens" in msg and "--max-running-requests" in msg


def test_requests_that_can_never_fit_are_refused(tiny_gemma):
    from freetoken.engine.engine import RequestRefused

    config = EngineConfig(model="tiny", dtype="float64", page_size=4, num_tokens=64, context_length=100)
    engine = build_engine_for(config, tiny_gemma)
    with pytest.raises(RequestRefused) as err:
        engine.add_request(Request("a", [5] * 90, SamplingParams(max_tokens=20)))
    assert err.value.code == "context_length_exceeded"
    with pytest.raises(RequestRefused):  # fits the context but not the 64-token pool
        engine.add_request(Request("b", [5] * 60, SamplingParams(max_tokens=20)))
    with pytest.raises(RequestRefused):
        engine.add_request(Request("c", [5, 999], SamplingParams(max_tokens=2)))
    assert not engine.has_work()
