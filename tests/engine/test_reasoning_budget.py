"""The reasoning budget in the engine (SamplingParams.reasoning_budget): with a budget of N the
model chooses N tokens of reasoning and then the output holds exactly end_ids, after which it
goes on as the model's own continuation of that text; a close the model writes itself is left
alone; start_ids delay the count; budget 0 closes at once; a batch's other requests are
untouched; preemption, seeded sampling and `--speculative ngram` give the same tokens; forced
tokens count toward max_tokens and report the model's logprob for them.

The tiny random Gemma in float64 (conftest.py), greedy unless said; the marker tokens are chosen
from each prompt's unbudgeted output, so the cases hold whatever the random weights write. The
speculative case also runs on an in-memory model that counts (every draft is accepted).
"""

from __future__ import annotations

import pytest
import torch

from test_engine_speculative import BigramRunner

from freetoken.config import EngineConfig
from freetoken.engine.build import build_engine_for
from freetoken.engine.engine import Engine, RequestRefused
from freetoken.kv.manager import KVManager
from freetoken.reasoning_budget import ReasoningBudget
from freetoken.request import Request, SamplingParams

PROMPTS = [[5, 17, 33, 60, 71, 90, 101, 140], [7, 7, 200, 13, 250], [64, 3, 99, 180, 44, 12, 8, 150, 30, 61, 77]]
MAX = 24
GREEDY = {"max_tokens": MAX, "temperature": 0.0, "ignore_eos": True}


def params(budget: ReasoningBudget | None = None, **overrides: object) -> SamplingParams:
    return SamplingParams(**{**GREEDY, **overrides}, reasoning_budget=budget)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def llm(tiny_gemma, make_llm):
    return make_llm(tiny_gemma, num_tokens=2048, max_running_requests=8)


@pytest.fixture(scope="module")
def free(llm) -> list[list[int]]:
    """Each prompt's unbudgeted greedy output."""
    return [o.token_ids for o in llm.generate(PROMPTS, params())]


def unused(tokens: list[int], n: int = 2) -> tuple[int, ...]:
    """n token ids that `tokens` does not hold (so the model does not write the marker itself)."""
    return tuple(t for t in range(300, 3, -1) if t not in tokens)[:n]


def first_new_pair(out: list[int], start: int) -> int:
    """The first i >= start whose pair (out[i], out[i + 1]) does not occur before i."""
    return next(i for i in range(start, len(out) - 1) if all(out[j : j + 2] != out[i : i + 2] for j in range(i)))


@pytest.mark.parametrize("n", [1, 4, 9])
def test_end_ids_follow_the_budget_then_the_model_goes_on(llm, free, n) -> None:
    for prompt, ref in zip(PROMPTS, free):
        end = unused(ref)
        out = llm.generate([prompt], params(ReasoningBudget(n, end_ids=end)))[0]
        assert out.token_ids[:n] == ref[:n]
        assert out.token_ids[n : n + 2] == list(end), (n, out.token_ids, end)
        assert len(out.token_ids) == MAX and out.finish_reason == "length"
        # after the close: what the model writes after that text, unbudgeted
        head = out.token_ids[: n + 2]
        tail = llm.generate([prompt + head], params(max_tokens=MAX - n - 2))[0].token_ids
        assert out.token_ids[n + 2 :] == tail


def test_budget_zero_closes_at_once(llm, free) -> None:
    ref = free[0]
    end = unused(ref, 3)
    out = llm.generate([PROMPTS[0]], params(ReasoningBudget(0, end_ids=end)))[0]
    assert out.token_ids[:3] == list(end)


def test_a_close_the_model_writes_is_left_alone(llm, free) -> None:
    for prompt, ref in zip(PROMPTS, free):
        i = first_new_pair(ref, 2)
        end = (ref[i], ref[i + 1])
        # the model closes at tokens i, i + 1: within a budget of i + 5, exactly on one of i + 2,
        # and on one of i + 1 the engine's completion of the started close is the model's own
        for n in (i + 5, i + 2, i + 1):
            out = llm.generate([prompt], params(ReasoningBudget(n, end_ids=end)))[0]
            assert out.token_ids == ref, (n, end)
        # the control: a budget that runs out first closes earlier (the pair is new at i >= 2)
        early = llm.generate([prompt], params(ReasoningBudget(0, end_ids=end)))[0]
        assert early.token_ids[:2] == list(end) != ref[:2]


def test_a_started_close_is_completed(llm, free) -> None:
    """The budget's last free token is end_ids[0]: only the rest of end_ids is forced."""
    ref = free[0]
    n = 5
    x = unused(ref, 1)[0]
    out = llm.generate([PROMPTS[0]], params(ReasoningBudget(n, end_ids=(ref[n - 1], x))))[0]
    assert out.token_ids[: n + 1] == ref[:n] + [x]


def test_the_count_starts_after_start_ids(llm, free) -> None:
    for prompt, ref in zip(PROMPTS, free):
        s = first_new_pair(ref, 1)
        start, end = (ref[s], ref[s + 1]), unused(ref)
        out = llm.generate([prompt], params(ReasoningBudget(3, start, end)))[0]
        opened = s + 2 + 3
        assert out.token_ids[:opened] == ref[:opened]
        assert out.token_ids[opened : opened + 2] == list(end)
        zero = llm.generate([prompt], params(ReasoningBudget(0, start, end)))[0]
        assert zero.token_ids[: s + 4] == ref[: s + 2] + list(end)
        # start_ids the model never writes: the budget never opens, nothing is forced
        never = llm.generate([prompt], params(ReasoningBudget(0, unused(ref, 4)[2:], end)))[0]
        assert never.token_ids == ref


def test_forced_tokens_count_toward_max_tokens(llm, free) -> None:
    ref = free[1]
    end = unused(ref, 3)
    out = llm.generate([PROMPTS[1]], params(ReasoningBudget(4, end_ids=end), max_tokens=6))[0]
    assert out.token_ids == ref[:4] + list(end[:2]) and out.finish_reason == "length"


def test_forced_tokens_report_the_models_logprob(llm, free) -> None:
    ref = free[2]
    n, end = 3, unused(ref)
    out = llm.generate([PROMPTS[2]], params(ReasoningBudget(n, end_ids=end), logprobs=2))[0]
    assert out.logprobs is not None and len(out.logprobs) == MAX
    forced = out.logprobs[n]
    assert forced.token_id == end[0]
    # the model's own distribution at that position: the top token is the one it would have chosen
    assert forced.top[0][0] == ref[n] and forced.logprob < forced.top[0][1]
    seq = PROMPTS[2] + out.token_ids[: n + 2]
    scored = llm.generate([seq], params(max_tokens=1, prompt_logprobs=0))[0].prompt_logprobs
    assert scored is not None
    for j in (n, n + 1):  # both forced tokens
        assert out.logprobs[j].logprob == pytest.approx(scored[len(PROMPTS[2]) + j].logprob, abs=1e-9)


@pytest.mark.parametrize("tight", [False, True])
def test_only_the_budgeted_request_of_a_batch_changes(tiny_gemma, make_llm, free, tight) -> None:
    """Chunked prefill, and (tight) a pool so small that requests are preempted and resumed."""
    flags = {"num_tokens": 4 * 14, "max_prefill_length": 8} if tight else {"num_tokens": 2048, "max_prefill_length": 8}
    batch = make_llm(tiny_gemma, max_running_requests=4, **flags)
    end = unused(free[1])
    budgeted = params(ReasoningBudget(2, end_ids=end))
    outs = batch.generate(PROMPTS, [params(), budgeted, params()])
    assert outs[0].token_ids == free[0] and outs[2].token_ids == free[2]
    assert outs[1].token_ids[:4] == free[1][:2] + list(end)
    solo = make_llm(tiny_gemma, num_tokens=2048).generate([PROMPTS[1]], budgeted)[0]
    assert outs[1].token_ids == solo.token_ids
    if tight:
        assert batch.engine.scheduler.preemptions > 0


def test_seeded_sampling_keeps_its_free_tokens(llm) -> None:
    sampled = {"temperature": 1.0, "top_p": 0.9, "seed": 7}
    ref = llm.generate([PROMPTS[0]], params(**sampled))[0].token_ids
    end = unused(ref)
    out = llm.generate([PROMPTS[0]], params(ReasoningBudget(6, end_ids=end), **sampled))[0].token_ids
    assert out[:8] == ref[:6] + list(end)


def test_ids_past_the_vocabulary_and_bad_budgets_are_refused(tiny_gemma) -> None:
    config = EngineConfig(model="tiny", dtype="float64", page_size=4, num_tokens=1024, debug_kv=True)
    engine = build_engine_for(config, tiny_gemma)
    vocab = engine.runner.vocab_size
    for budget in (ReasoningBudget(4, end_ids=(vocab,)), ReasoningBudget(4, (vocab + 3,), (5,))):
        with pytest.raises(RequestRefused) as err:
            engine.add_request(Request("r", [1, 2, 3], params(budget)))
        assert err.value.param == "reasoning_budget"
    for budget in (ReasoningBudget(-1, end_ids=(5,)), ReasoningBudget(4)):
        with pytest.raises(ValueError, match="^reasoning_budget "):
            engine.add_request(Request("r", [1, 2, 3], params(budget)))
    assert not engine.has_work()


# -- speculative decoding -------------------------------------------------------------------

SPEC = {"speculative": "ngram", "spec_ngram_min": 1}


def repeating(n: int) -> list[list[int]]:
    """Prompts that repeat a block, so the n-gram drafts get accepted."""
    blocks = [[11, 42, 97, 150, 203, 37, 88], [260, 14, 71, 190, 5, 133], [9, 301, 55, 120, 240, 66, 18, 99]]
    return [blocks[i % 3] * 3 + blocks[i % 3][:3] for i in range(n)]


@pytest.mark.parametrize("n", [0, 1, 3, 6, 10])
def test_speculation_gives_the_same_tokens(tiny_gemma, make_llm, n) -> None:
    prompts = repeating(3)
    budget = ReasoningBudget(n, end_ids=(304, 305))
    cases = [params(budget), params(budget, temperature=0.9, seed=3), params(ReasoningBudget(n, (97, 150), (304, 305)))]
    plain = make_llm(tiny_gemma, num_tokens=2048).generate(prompts, cases)
    spec_llm = make_llm(tiny_gemma, num_tokens=2048, spec_max_draft=6, **SPEC)
    spec = spec_llm.generate(prompts, cases)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert spec_llm.engine.accepted_tokens > 0


class CountingRunner:
    """A model in the engine's Runner interface that counts: after token t < 8 comes (t + 1) % 8,
    after any other token 0. Greedy, every n-gram draft of a counting prompt is accepted, so a
    draft would run through the budget's end unless the speculator stops it there."""

    vocab_size = 12
    resizable = False

    def forward(self, items) -> torch.Tensor:
        rows = BigramRunner.previous_tokens(items)
        nxt = torch.tensor([(t + 1) % 8 if t < 8 else 0 for t in rows])
        return torch.nn.functional.one_hot(nxt, self.vocab_size).float() * 10.0

    def resize_kv(self, kind: str, pages: int) -> None:
        raise AssertionError("not resized in this test")


def counting_engine(**flags: object) -> Engine:
    config = EngineConfig(model="counting", page_size=4, num_tokens=4 * 256, debug_kv=True, **flags)  # type: ignore[arg-type]
    resolved = config.resolve(model_context_length=256, window=None, kv_bytes_per_token=1, available_bytes=1 << 30)
    kv = KVManager(full_pages=resolved.full_pages, swa_pages=None, page_size=4, window=None, cache_type="radix")
    return Engine(resolved, CountingRunner(), kv, None)  # type: ignore[arg-type]


@pytest.mark.parametrize("n", [0, 2, 5, 9])
def test_drafts_stop_where_the_budget_forces(n: int) -> None:
    prompt = list(range(8)) * 3
    expected = [t % 8 for t in range(n)] + [8, 9] + [t % 8 for t in range(20 - n - 2)]
    for flags in ({}, {**SPEC, "spec_max_draft": 8}):
        engine = counting_engine(**flags)
        req = Request("r", prompt, params(ReasoningBudget(n, end_ids=(8, 9)), max_tokens=20))
        engine.add_request(req)
        while engine.has_work():
            engine.step()
        assert req.output_ids == expected, flags
        if flags:
            assert req.report.accepted_tokens >= 10  # long chunks before and after the close
