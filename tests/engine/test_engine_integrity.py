"""An integrity failure in service is a diagnostic: pages quarantined, holders ended with an
error, everyone else served. Under debug_kv it is fatal."""

from __future__ import annotations

import pytest

from freetoken.config import EngineConfig
from freetoken.engine.build import build_engine_for
from freetoken.kv.errors import KVIntegrityError
from freetoken.request import FinishReason, Request, SamplingParams


def make(model, debug: bool):
    config = EngineConfig(model="tiny", dtype="float64", page_size=4, num_tokens=400, max_running_requests=4,
                          max_prefill_length=64, debug_kv=debug)
    return build_engine_for(config, model)


def start_two(engine):
    a = Request("A", list(range(10, 40)), SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    b = Request("B", list(range(100, 120)), SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    engine.add_request(a)
    engine.add_request(b)
    engine.step()  # both prefilled, both running
    return a, b


def test_corrupted_refcount_is_quarantined_and_serving_goes_on(tiny_gemma):
    engine = make(tiny_gemma, debug=False)
    a, b = start_two(engine)
    page = int(engine.kv.page_tables("B")[0][0])
    engine.kv.full_pool.rc[page] += 1  # a stray reference nobody holds
    ended = engine.audit_now()
    assert [(u.rid, u.finish_reason) for u in ended] == [("B", FinishReason.ERROR)]
    assert "integrity" in ended[0].error
    assert b.finished and b.finish_reason is FinishReason.ERROR
    while engine.has_work():
        engine.step()
    assert a.finish_reason is FinishReason.LENGTH and len(a.output_ids) == 8
    status = engine.status()
    assert status["integrity"]["violations"] == 1 and not status["integrity"]["ok"]
    assert str(page) in status["integrity"]["last_error"]
    full = status["pools"]["full"]
    assert full["quarantined"] == 1 and full["in_use"] == 0
    assert full["free"] + full["cached"] + full["quarantined"] == full["capacity"]
    # The engine keeps serving, and never hands out the quarantined page again.
    c = Request("C", list(range(50, 90)), SamplingParams(max_tokens=4, temperature=0.0))
    engine.add_request(c)
    engine.step()
    assert page not in engine.kv.page_tables("C")[0].tolist()
    while engine.has_work():
        engine.step()
    assert c.finish_reason is FinishReason.LENGTH
    assert engine.status()["integrity"]["violations"] == 1  # nothing new failed at idle


def test_integrity_failure_is_fatal_under_debug_kv(tiny_gemma):
    engine = make(tiny_gemma, debug=True)
    start_two(engine)
    page = int(engine.kv.page_tables("A")[0][0])
    engine.kv.full_pool.rc[page] += 1
    with pytest.raises(KVIntegrityError) as err:
        engine.step()
    assert f"page={page}" in str(err.value) or str(page) in str(err.value)
