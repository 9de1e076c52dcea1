"""When the engine commits a request's K/V to the prefix tree: after each prompt chunk (the
last one, which samples, included) and at finish, never on a decode step (a commit per request
per step would be pure overhead: decode K/V is committed once, at finish)."""

from __future__ import annotations

from freetoken.request import Request, SamplingParams


def test_commits_after_prompt_chunks_and_at_finish_only(tiny_llama, make_llm, monkeypatch):
    llm = make_llm(tiny_llama, max_prefill_length=8, num_tokens=512)
    calls: list[int] = []
    real_commit = llm.engine.kv.commit

    def spy(rid, tokens, *args, **kwargs):
        calls.append(len(tokens))
        return real_commit(rid, tokens, *args, **kwargs)

    monkeypatch.setattr(llm.engine.kv, "commit", spy)
    prompt = list(range(3, 23))  # 20 tokens: chunks of 8, 8 and 4 (the last one samples)
    out = llm.generate([prompt], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 10
    # three prompt chunks, then one finish-time commit of prompt + output - 1
    assert calls == [8, 16, 20, 20 + 10 - 1]


def test_a_second_request_hits_the_whole_prompt_while_the_first_decodes(tiny_llama, make_llm):
    llm = make_llm(tiny_llama, max_prefill_length=64, num_tokens=512)
    prompt = list(range(3, 40))  # one chunk that samples: committed right after it
    engine = llm.engine
    engine.add_request(Request("a", prompt, SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)))
    engine.step()  # a's prefill (and its first token)
    engine.add_request(Request("b", prompt, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)))
    engine.step()
    assert engine.requests["b"].report.cached_tokens == 36  # floor_to_page(37 - 1) with pages of 4
