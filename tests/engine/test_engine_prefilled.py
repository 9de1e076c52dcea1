"""`Engine.prefilled_tokens` (the periodic log line's prefill rate) counts the prompt tokens the
engine computed: every chunk of a prompt once, and none of what a prefix-cache hit supplied."""

from __future__ import annotations

from freetoken.request import SamplingParams

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def test_prefilled_counts_computed_prompt_tokens_not_cache_hits(tiny_gemma, make_llm) -> None:  # type: ignore[no-untyped-def]
    llm = make_llm(tiny_gemma, max_prefill_length=7, num_tokens=1024)  # chunks of 7: several per prompt
    prompt = [3 + (i * 7) % 300 for i in range(40)]
    first = llm.generate([prompt], GREEDY)[0]
    assert first.cached_tokens == 0 and llm.engine.prefilled_tokens == 40  # decode steps add nothing
    second = llm.generate([prompt], GREEDY)[0]
    assert second.cached_tokens > 0
    assert llm.engine.prefilled_tokens == 40 + (40 - second.cached_tokens)
