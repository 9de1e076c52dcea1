"""A prompt sent again hits the prefix cache on a sliding-window model, whatever its length.

A resend must compute its last token, so its hit is capped one token short of the prompt; for a
page-aligned prompt that is one whole page short of the prompt's end. The window before that point
has to be live in the tree, and a prompt prefilled in one chunk commits only its end's window, so
the chunk that ends a prompt also keeps the window where a resend of it hits (DESIGN §3). Before,
such a prompt longer than the window never hit again (Gemma 3: an 864-token prompt, 0 cached)."""

from __future__ import annotations

import pytest

from freetoken.request import SamplingParams

GREEDY = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
PAGE = 4  # the tiny Gemma's window is 7 tokens: two pages and a bit


@pytest.mark.parametrize("length", [24, 25, 27])  # page-aligned, one past, one short of the next page
def test_a_prompt_sent_again_hits_one_page_short_at_most(tiny_gemma, make_llm, length: int) -> None:  # type: ignore[no-untyped-def]
    llm = make_llm(tiny_gemma, page_size=PAGE, max_prefill_length=400, num_tokens=1024)  # one chunk
    prompt = [3 + (i * 11) % 300 for i in range(length)]
    first = llm.generate([prompt], GREEDY)[0]
    second = llm.generate([prompt], GREEDY)[0]
    assert first.cached_tokens == 0
    assert second.cached_tokens == (length - 1) // PAGE * PAGE  # the cap: at least one token computed
    assert second.token_ids == first.token_ids
    assert llm.engine.kv.audit(idle=True).ok
