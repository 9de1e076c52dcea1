"""The sampler: greedy, filters, seeds, penalties and logprobs on hand-made logits."""

from __future__ import annotations

import math

import torch

from freetoken.engine.sampler import prompt_logprobs, sample
from freetoken.request import Request, SamplingParams


def req(params: SamplingParams, prompt=(1, 2), output=()) -> Request:
    r = Request("r", list(prompt), params, output_ids=list(output))
    if params.seed is not None:
        r.generator = torch.Generator().manual_seed(params.seed)
    return r


LOGITS = torch.tensor([[0.0, 1.0, 3.0, 2.0, -1.0]])


def draws(params: SamplingParams, n: int = 300) -> set[int]:
    r = req(params)
    return {sample(LOGITS.clone(), [r]).token_ids[0] for _ in range(n)}


def test_greedy_and_filters_that_leave_one_token() -> None:
    assert sample(LOGITS.clone(), [req(SamplingParams(temperature=0))]).token_ids == [2]
    assert draws(SamplingParams(temperature=1.0, top_k=1)) == {2}
    assert draws(SamplingParams(temperature=1.0, top_p=0.01)) == {2}
    assert draws(SamplingParams(temperature=1.0, min_p=0.9)) == {2}


def test_top_k_and_top_p_limit_the_support() -> None:
    assert draws(SamplingParams(temperature=1.0, top_k=2)) == {2, 3}
    # softmax of [0,1,3,2,-1]: token 2 has 0.64, 2+3 reach 0.88: top_p 0.8 keeps exactly those two
    assert draws(SamplingParams(temperature=1.0, top_p=0.8)) == {2, 3}
    assert draws(SamplingParams(temperature=5.0), 2000) == {0, 1, 2, 3, 4}


def test_seeded_requests_repeat_whatever_the_batch() -> None:
    p = SamplingParams(temperature=1.0, seed=42)
    alone = [sample(torch.randn(1, 50, generator=torch.Generator().manual_seed(i)), [req(p)]).token_ids[0] for i in range(5)]
    r = req(p)
    seq = []
    for i in range(5):
        logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(i))
        other = req(SamplingParams(temperature=1.0))
        seq.append(sample(torch.cat([torch.randn(1, 50), logits]), [other, r]).token_ids[1])
    first = req(p)
    again = [sample(torch.randn(1, 50, generator=torch.Generator().manual_seed(i)), [first]).token_ids[0] for i in range(5)]
    assert seq == again  # one generator carried across steps, unaffected by the batch neighbour
    assert alone[0] == again[0]


def test_penalties_push_away_from_seen_tokens() -> None:
    rep = req(SamplingParams(temperature=0, repetition_penalty=10.0), prompt=(2,))
    assert sample(LOGITS.clone(), [rep]).token_ids == [3]
    freq = req(SamplingParams(temperature=0, frequency_penalty=2.0), output=(2,))
    assert sample(LOGITS.clone(), [freq]).token_ids == [3]  # 3 - 2 = 1 < 2
    pres = req(SamplingParams(temperature=0, presence_penalty=0.5), output=(2, 2, 2))
    assert sample(LOGITS.clone(), [pres]).token_ids == [2]  # 3 - 0.5 still the best


def test_logprobs_of_chosen_and_top_tokens() -> None:
    out = sample(LOGITS.clone(), [req(SamplingParams(temperature=0, logprobs=2))])
    lp = out.logprobs[0]
    expected = torch.log_softmax(LOGITS[0], dim=-1)
    assert lp.token_id == 2 and math.isclose(lp.logprob, float(expected[2]), rel_tol=1e-6)
    assert [t for t, _ in lp.top] == [2, 3]
    rows = prompt_logprobs(LOGITS.repeat(2, 1), [4, 1], k=0)
    assert [round(r.logprob, 5) for r in rows] == [round(float(expected[4]), 5), round(float(expected[1]), 5)]


def test_parameter_validation_names_the_parameter() -> None:
    import pytest

    for bad, name in [(dict(max_tokens=0), "max_tokens"), (dict(top_p=0.0), "top_p"), (dict(temperature=-1), "temperature"),
                      (dict(logprobs=50), "logprobs"), (dict(min_p=2.0), "min_p")]:
        with pytest.raises(ValueError, match=name):
            SamplingParams(**bad).validate()

