"""The failure of the engine FreeToken replaces (DESIGN.md §3, "Known failure"), through the
engine: A long and still running, B short sharing A's first 5 tokens, batched with A's last
prefill chunk, decoding beside A. Here it finishes cleanly, audit after every step."""

from __future__ import annotations

import pytest

from freetoken.config import EngineConfig
from freetoken.engine.build import build_engine_for
from freetoken.request import Request, SamplingParams

A_PROMPT = [10 + (i * 37) % 300 for i in range(44)]  # 44 tokens: six windows of 7


def run_overlap(engine, b_prompt: list[int], b_max: int, *, b_after_a: bool = False, a_prompt=A_PROMPT):
    a = Request("A", list(a_prompt), SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    b = Request("B", list(b_prompt), SamplingParams(max_tokens=b_max, temperature=0.0, ignore_eos=True))
    engine.add_request(a)
    b_added = False
    overlapped = False
    chunk = engine.config.engine.max_prefill_length
    while engine.has_work() or not b_added:
        # B arrives when A has one prefill chunk left, so B's prefill shares A's last chunk step.
        if not b_added and (b_after_a and a.finished or not b_after_a and len(a.prompt_ids) - a.num_computed <= chunk):
            engine.add_request(b)
            b_added = True
        engine.step()
        if b.finished and not a.finished:
            overlapped = True
    return a, b, overlapped


def balanced_at_idle(engine) -> None:
    status = engine.status()
    assert status["integrity"]["violations"] == 0
    for pool in status["pools"].values():
        assert pool["in_use"] == 0
        assert pool["free"] + pool["cached"] == pool["capacity"]
    report = engine.kv.audit(idle=True)
    assert report.ok, str(report)


def engine_for(model, **flags):
    base = dict(model="tiny", dtype="float64", page_size=1, num_tokens=400, max_running_requests=4,
                max_prefill_length=12, debug_kv=True)
    base.update(flags)
    return build_engine_for(EngineConfig(**base), model)


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("b_max", [2, 4, 8])
def test_seed_overlap_short_b_sharing_five_tokens(tiny_gemma, page_size, b_max):
    engine = engine_for(tiny_gemma, page_size=page_size)
    b_prompt = A_PROMPT[:5] + [301, 302, 303]
    a, b, overlapped = run_overlap(engine, b_prompt, b_max)
    assert overlapped, "B must finish while A is still running"
    assert len(b.output_ids) == b_max and len(a.output_ids) == 12
    balanced_at_idle(engine)


@pytest.mark.parametrize(
    "name,b_prompt,b_max,after",
    [
        ("b_max_tokens_1", A_PROMPT[:5] + [301, 302, 303], 1, False),
        ("b_shares_a_long_prefix", A_PROMPT[:30] + [301, 302], 4, False),
        ("b_shares_nothing", [301, 302, 303, 304, 305, 306, 307, 308], 4, False),
        ("b_after_a", A_PROMPT[:5] + [301, 302, 303], 4, True),
    ],
)
def test_seed_ablation_rows(tiny_gemma, name, b_prompt, b_max, after):
    engine = engine_for(tiny_gemma)
    a, b, _ = run_overlap(engine, b_prompt, b_max, b_after_a=after)
    assert a.finished and b.finished and len(b.output_ids) == b_max
    balanced_at_idle(engine)


def test_seed_two_short_prompts(tiny_gemma):
    engine = engine_for(tiny_gemma)
    a, b, _ = run_overlap(engine, [7, 8, 9, 10, 11, 12], 4, a_prompt=[7, 8, 9, 10, 11, 13, 14])
    assert a.finished and b.finished
    balanced_at_idle(engine)


def test_seed_with_naive_cache(tiny_gemma):
    engine = engine_for(tiny_gemma, cache_type="naive")
    a, b, overlapped = run_overlap(engine, A_PROMPT[:5] + [301, 302, 303], 4)
    assert overlapped
    balanced_at_idle(engine)


def test_identical_prompts_admitted_in_one_step(tiny_gemma):
    engine = engine_for(tiny_gemma, page_size=4, max_running_requests=6, max_prefill_length=400)
    reqs = [Request(f"n{i}", list(A_PROMPT), SamplingParams(max_tokens=5, temperature=0.0)) for i in range(6)]
    for r in reqs:
        engine.add_request(r)
    engine.step()
    assert all(r.num_computed == len(A_PROMPT) for r in reqs), "all six must be admitted in the first step"
    while engine.has_work():
        engine.step()
    assert len({tuple(r.output_ids) for r in reqs}) == 1
    balanced_at_idle(engine)


@pytest.mark.real_model
def test_seed_overlap_on_real_gemma(real_gemma_loaded):
    config = EngineConfig(model="gemma3-270m", dtype="float32", page_size=16, num_tokens=4096, max_running_requests=4,
                          max_prefill_length=512, debug_kv=True)
    engine = build_engine_for(config, real_gemma_loaded)
    tok = real_gemma_loaded.tokenizer
    a_prompt = tok.encode(" ".join(f"word{i}" for i in range(700)))  # several 512-token windows
    assert len(a_prompt) > 3 * 512
    b_prompt = a_prompt[:5] + tok.encode("probe hi", add_special_tokens=False)
    a, b, overlapped = run_overlap(engine, b_prompt, 4, a_prompt=a_prompt)
    assert overlapped
    balanced_at_idle(engine)
