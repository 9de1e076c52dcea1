"""`logit_bias` in the sampler: added per row in one scatter over the batch, for greedy and
sampled rows alike, the wire form (lists) normalised back to pairs, and the range check."""

from __future__ import annotations

import pytest
import torch

from freetoken.engine.sampler import sample
from freetoken.request import Request, SamplingParams

LOGITS = torch.tensor([[0.0, 1.0, 3.0, 2.0, -1.0]])


def req(params: SamplingParams) -> Request:
    return Request("r", [1, 2], params)


def test_bias_moves_the_greedy_choice_per_row() -> None:
    plain = req(SamplingParams(temperature=0))
    banned = req(SamplingParams(temperature=0, logit_bias=((2, -100.0),)))
    pushed = req(SamplingParams(temperature=0, logit_bias=((4, 5.0), (0, 1.0))))
    out = sample(LOGITS.repeat(3, 1), [plain, banned, pushed])
    assert out.token_ids == [2, 3, 4]  # rows without a bias are untouched


def test_bias_restricts_sampled_rows() -> None:
    bias = tuple((t, -100.0) for t in (0, 1, 2))
    r = req(SamplingParams(temperature=1.0, logit_bias=bias))
    assert {sample(LOGITS.clone(), [r]).token_ids[0] for _ in range(200)} == {3, 4}


def test_logprobs_are_of_the_unbiased_row() -> None:
    r = req(SamplingParams(temperature=0, logprobs=0, logit_bias=((4, 100.0),)))
    out = sample(LOGITS.clone(), [r])
    assert out.token_ids == [4]
    expected = float(LOGITS.log_softmax(dim=-1)[0, 4])
    assert out.logprobs[0] is not None and out.logprobs[0].logprob == pytest.approx(expected)


def test_wire_form_and_range() -> None:
    assert SamplingParams(logit_bias=[[3, 1], [5, -2.5]]).logit_bias == ((3, 1.0), (5, -2.5))  # type: ignore[arg-type]
    hash(SamplingParams(logit_bias=[[3, 1]]))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="^logit_bias"):
        SamplingParams(logit_bias=((3, 101.0),)).validate()
    with pytest.raises(ValueError, match="^logit_bias"):
        SamplingParams(logit_bias=((-1, 1.0),)).validate()
