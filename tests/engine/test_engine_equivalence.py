"""Greedy outputs do not depend on how the engine batches, chunks or caches (float64)."""

from __future__ import annotations

import random

import pytest
import torch

from freetoken.request import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Prompts longer than the tiny Gemma window (7), some sharing long prefixes."""
    rng = random.Random(seed)
    head = [rng.randrange(3, 320) for _ in range(30)]
    out = []
    for i in range(n):
        tail = [rng.randrange(3, 320) for _ in range(rng.randrange(1, 25))]
        out.append((head[: rng.randrange(0, 31)] if i % 2 else []) + tail + [rng.randrange(3, 320)] * 3)
    return out


@pytest.fixture(scope="module")
def solo(tiny_gemma, make_llm) -> dict[int, list[int]]:
    """Each prompt alone, whole prompt in one chunk, no prefix cache."""
    llm = make_llm(tiny_gemma, cache_type="naive", max_running_requests=1, max_prefill_length=256, num_tokens=512)
    return {i: llm.generate([p], GREEDY)[0].token_ids for i, p in enumerate(prompts(8))}


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_batched_and_chunked_equal_alone(tiny_gemma, make_llm, solo, chunk):
    llm = make_llm(tiny_gemma, max_running_requests=8, max_prefill_length=chunk, num_tokens=1024)
    outs = llm.generate(prompts(8), GREEDY)
    assert {i: o.token_ids for i, o in enumerate(outs)} == solo
    assert llm.engine.steps > 0


def test_prefix_cache_hits_do_not_change_outputs(tiny_gemma, make_llm, solo):
    llm = make_llm(tiny_gemma, max_running_requests=4, max_prefill_length=16, num_tokens=1024)
    first = llm.generate(prompts(8), GREEDY)
    second = llm.generate(prompts(8), GREEDY)  # the same prompts again: long prefix hits
    assert [o.token_ids for o in first] == [solo[i] for i in range(8)]
    assert [o.token_ids for o in second] == [solo[i] for i in range(8)]
    assert sum(o.cached_tokens for o in second) > 0
    assert all(o.cached_tokens < len(p) for o, p in zip(second, prompts(8)))


def test_naive_cache_equals_radix(tiny_gemma, make_llm, solo):
    llm = make_llm(tiny_gemma, cache_type="naive", max_running_requests=8, max_prefill_length=7, num_tokens=1024)
    outs = llm.generate(prompts(8), GREEDY)
    assert [o.token_ids for o in outs] == [solo[i] for i in range(8)]
    assert all(o.cached_tokens == 0 for o in outs)


def test_engine_matches_transformers_greedy(tiny_gemma, make_llm, solo):
    import transformers

    ref = transformers.AutoModelForCausalLM.from_pretrained(
        tiny_gemma.source.path, dtype=torch.float64, attn_implementation="eager"
    ).eval()
    for i, p in enumerate(prompts(4)):
        with torch.no_grad():
            out = ref.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert out[0, len(p):].tolist() == solo[i]


def test_llama_without_windows(tiny_llama, make_llm):
    one = make_llm(tiny_llama, cache_type="naive", max_running_requests=1, max_prefill_length=256, num_tokens=512)
    many = make_llm(tiny_llama, max_running_requests=8, max_prefill_length=5, num_tokens=512)
    ps = prompts(6, seed=3)
    assert [o.token_ids for o in many.generate(ps, GREEDY)] == [one.generate([p], GREEDY)[0].token_ids for p in ps]
    assert many.engine.kv.resolved_cache_type == "radix"
