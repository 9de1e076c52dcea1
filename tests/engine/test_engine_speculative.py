"""Speculative decoding (`--speculative ngram`) changes how fast tokens come, never which ones.

Tiny random-weight models in float64 (tests/engine/conftest.py): greedy outputs are identical
with and without speculation, over prompts that repeat their context (the drafts are accepted)
and prompts that do not, batched, chunked and under preemption; seeded sampled requests give the
same tokens too (the generator is rewound); unseeded samples follow the model's own distribution
(a chi-square test against the exact joint distribution of three tokens); a stop token inside
accepted drafts ends the request there; opted-out, grammar and penalised requests never draft;
randomized traffic with speculation keeps the audit clean after every step.
"""

from __future__ import annotations

import random

import pytest
import torch
from scipy.stats import chisquare
from test_engine_stress import run_random_traffic

from freetoken.config import EngineConfig
from freetoken.engine.build import build_engine_for
from freetoken.request import FinishReason, Request, SamplingParams

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
SPEC = {"speculative": "ngram", "spec_ngram_min": 1}


def repeating(n: int, seed: int = 0) -> list[list[int]]:
    """Prompts that repeat their context (a block twice and part of it again), and prompts that
    do not (fresh random tokens)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        block = [rng.randrange(3, 320) for _ in range(rng.randrange(6, 20))]
        out.append(block * 2 + block[: rng.randrange(1, len(block))] if i % 2 == 0 else block + block[::-1][:3])
    return out


def generate(llm, prompts, params):
    return [o.token_ids for o in llm.generate(prompts, params)]


@pytest.fixture(scope="module")
def reference(tiny_gemma, make_llm):
    llm = make_llm(tiny_gemma, max_running_requests=8, max_prefill_length=64, num_tokens=2048)
    return generate(llm, repeating(6), GREEDY)


@pytest.mark.parametrize("max_draft,chunk,page_size", [(1, 64, 4), (5, 7, 1)])
def test_greedy_identical_with_speculation(tiny_gemma, make_llm, reference, max_draft, chunk, page_size):
    llm = make_llm(tiny_gemma, max_running_requests=6, max_prefill_length=chunk, num_tokens=2048,
                   page_size=page_size, spec_max_draft=max_draft, **SPEC)
    assert generate(llm, repeating(6), GREEDY) == reference
    engine = llm.engine
    assert engine.drafted_tokens > 0 and 0 < engine.accepted_tokens < engine.drafted_tokens


def test_greedy_identical_on_a_model_without_windows(tiny_llama, make_llm):
    plain = make_llm(tiny_llama, max_running_requests=4, num_tokens=1024)
    spec = make_llm(tiny_llama, max_running_requests=4, num_tokens=1024, spec_max_draft=4, **SPEC)
    assert generate(spec, repeating(6, seed=1), GREEDY) == generate(plain, repeating(6, seed=1), GREEDY)
    assert spec.engine.accepted_tokens > 0


def test_greedy_identical_under_preemption(tiny_gemma, make_llm, reference):
    llm = make_llm(tiny_gemma, max_running_requests=6, max_prefill_length=16, num_tokens=4 * 30, **SPEC)
    assert generate(llm, repeating(6), GREEDY) == reference
    assert llm.engine.scheduler.preemptions > 0 and llm.engine.accepted_tokens > 0


SAMPLED = [
    SamplingParams(max_tokens=20, temperature=0.8, seed=11, ignore_eos=True),
    SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, seed=12, ignore_eos=True, logprobs=2),
    SamplingParams(max_tokens=20, temperature=0.7, top_k=5, min_p=0.05, seed=13, ignore_eos=True),
    SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, logprobs=1),
]


def test_seeded_sampling_identical_with_speculation(tiny_gemma, make_llm):
    prompts = repeating(4, seed=2)
    plain = make_llm(tiny_gemma, max_running_requests=4, num_tokens=2048).generate(prompts, SAMPLED)
    spec_llm = make_llm(tiny_gemma, max_running_requests=4, num_tokens=2048, **SPEC)
    spec = spec_llm.generate(prompts, SAMPLED)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    for a, b in zip(spec, plain):
        if b.logprobs is not None:
            assert [x.token_id for x in a.logprobs] == [x.token_id for x in b.logprobs]
            assert [x.logprob for x in a.logprobs] == pytest.approx([x.logprob for x in b.logprobs], abs=1e-9)
    assert spec_llm.engine.accepted_tokens > 0, (spec_llm.engine.drafted_tokens, spec_llm.engine.accepted_tokens)


class BigramRunner:
    """A tiny model built in memory, in the engine's Runner interface: the next token's logits
    are a fixed random row per previous token (a bigram model), so the exact distribution of a
    continuation is a product of known rows, and a forward costs nothing (the statistical test
    needs thousands of requests)."""

    vocab_size = 4
    resizable = False

    def __init__(self) -> None:
        self.table = torch.randn(self.vocab_size, self.vocab_size, generator=torch.Generator().manual_seed(5), dtype=torch.float64) * 1.5

    @staticmethod
    def previous_tokens(items) -> list[int]:
        """The token before each logits row the engine asks for: every row of a verified draft,
        the last row of a sampling prefill or decode."""
        rows: list[int] = []
        for item in items:
            tokens = item.req.token_slice(0, item.start + item.n - len(item.draft)) + list(item.draft)
            if item.draft:
                rows.extend(tokens[item.start : item.start + item.n])
            elif item.samples:
                rows.append(tokens[-1])
        return rows

    def forward(self, items) -> torch.Tensor:
        return self.table[self.previous_tokens(items)].float()

    def resize_kv(self, kind: str, pages: int) -> None:
        raise AssertionError("not resized in this test")

    def probs(self, last: int) -> torch.Tensor:
        return torch.softmax(self.table[last], dim=-1)


def test_sampled_outputs_follow_the_models_distribution():
    """Unseeded requests (their rows draw from the global generator, seeded once: deterministic)
    with 2-token drafts: the joint distribution of the first three tokens (the second and third
    come from verified rows, accepted or corrected) matches the model's exact one (chi-square
    over 64 cells). The seeded test above shows the real models' rows are the plain ones."""
    from freetoken.engine.engine import Engine

    config = EngineConfig(model="bigram", page_size=4, num_tokens=4 * 2048, max_running_requests=256,
                          debug_kv=True, spec_max_draft=2, **SPEC)
    resolved = config.resolve(model_context_length=64, window=None, kv_bytes_per_token=1, available_bytes=1 << 30)
    from freetoken.kv.manager import KVManager

    kv = KVManager(full_pages=resolved.full_pages, swa_pages=None, page_size=4, window=None, cache_type="radix")
    runner = BigramRunner()
    engine = Engine(resolved, runner, kv, None)  # type: ignore[arg-type]
    prompt = [0, 1, 2, 3, 0, 2, 1, 3, 2, 0, 3, 1, 1, 0, 0, 3, 3, 2, 2, 1]  # every bigram: a draft always exists
    n = 3000
    torch.manual_seed(1234)
    reqs = [Request(f"r{i}", prompt, SamplingParams(max_tokens=3, temperature=1.0)) for i in range(n)]
    for r in reqs:
        engine.add_request(r)
    while engine.has_work():
        engine.step()
    assert engine.drafted_tokens >= n  # every request verified a draft at its second token
    assert 0.2 * engine.drafted_tokens < engine.accepted_tokens < 0.8 * engine.drafted_tokens
    counts: dict[tuple[int, ...], int] = {}
    for r in reqs:
        counts[tuple(r.output_ids)] = counts.get(tuple(r.output_ids), 0) + 1
    v = runner.vocab_size
    cells = [(a, b, c) for a in range(v) for b in range(v) for c in range(v)]
    exact = {
        (a, b, c): float(runner.probs(prompt[-1])[a] * runner.probs(a)[b] * runner.probs(b)[c]) for a, b, c in cells
    }
    assert set(counts) <= set(cells)
    observed = [counts.get(k, 0) for k in cells]
    expected = [exact[k] * n for k in cells]
    result = chisquare(observed, expected)
    assert result.pvalue > 1e-3, (result, list(zip(observed, expected)))


def test_stop_token_inside_accepted_drafts(tiny_gemma, make_llm, reference):
    """A stop token in the middle of a verified chunk ends the request at that token."""
    i = 0
    out = reference[i]
    cut = next(j for j in range(4, len(out)) if out[j] not in out[:j])  # first occurrence after a few tokens
    params = SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=(out[cut],))
    llm = make_llm(tiny_gemma, num_tokens=1024, spec_max_draft=8, **SPEC)
    got = llm.generate([repeating(8)[i]], params)[0]
    assert got.token_ids == out[: cut + 1] and got.finish_reason == FinishReason.STOP.value
    assert llm.engine.accepted_tokens > 0


def test_who_drafts(tiny_gemma, make_llm):
    """Opted-out, grammar-constrained and penalised requests never draft; the others do."""
    prompt = repeating(1)[0]
    base = {"max_tokens": 16, "temperature": 0.0, "ignore_eos": True}
    cases = {
        "opt_out": SamplingParams(**base, speculative=False),
        "penalty": SamplingParams(**base, repetition_penalty=1.2),
        "presence": SamplingParams(**base, presence_penalty=0.5),
        "grammar": SamplingParams(**base, grammar=("regex", "[a-z ]+")),
        "plain": SamplingParams(**base),
    }
    config = EngineConfig(model="tiny", dtype="float64", page_size=4, num_tokens=1024, debug_kv=True, **SPEC)
    engine = build_engine_for(config, tiny_gemma)
    reqs = {name: Request(name, prompt, params) for name, params in cases.items()}
    for req in reqs.values():
        engine.add_request(req)
    while engine.has_work():
        engine.step()
    assert reqs["plain"].report.drafted_tokens > 0
    assert all(reqs[k].report.drafted_tokens == 0 for k in cases if k != "plain"), {k: r.report for k, r in reqs.items()}


def test_random_traffic_with_speculation_keeps_the_audit(tiny_gemma):
    config = EngineConfig(
        model="tiny", dtype="float64", page_size=4, num_tokens=4 * 40, max_running_requests=6,
        max_prefill_length=12, swa_pool_tokens="floor", debug_kv=True, speculative="ngram",
        spec_max_draft=4, spec_ngram_min=1,
    )
    engine = build_engine_for(config, tiny_gemma)
    reqs, aborted = run_random_traffic(engine, 2, n_requests=24, burst=True)
    for rid, req in reqs.items():
        assert req.finished
        if rid not in aborted:
            assert len(req.output_ids) == req.params.max_tokens
    assert engine.scheduler.preemptions > 0
    assert engine.accepted_tokens > 0 and engine.drafted_tokens > engine.accepted_tokens
    status = engine.status()
    for pool in status["pools"].values():
        assert pool["in_use"] == 0 and pool["free"] + pool["cached"] == pool["capacity"]
    assert status["integrity"]["violations"] == 0


def test_request_update_reports_drafted_and_accepted(tiny_gemma):
    config = EngineConfig(model="tiny", dtype="float64", page_size=4, num_tokens=1024, debug_kv=True, **SPEC)
    engine = build_engine_for(config, tiny_gemma)
    req = Request("a", repeating(1)[0], GREEDY)
    engine.add_request(req)
    last = None
    while engine.has_work():
        for upd in engine.step():
            last = upd
    assert last is not None and last.finished
    report = req.report
    assert (last.report.drafted_tokens, last.report.accepted_tokens) == (report.drafted_tokens, report.accepted_tokens)
    assert report.accepted_tokens > 0
    assert engine.drafted_tokens == report.drafted_tokens
    status = engine.status()["speculative"]
    assert status == {"method": "ngram", "drafted_tokens": report.drafted_tokens, "accepted_tokens": report.accepted_tokens}
    from freetoken.server.operations.metrics import Metrics

    metrics = Metrics()
    metrics.update_engine(up=True, restarts=0, in_flight=0, status=engine.status())
    text = metrics.render().decode()
    assert f"freetoken_spec_drafted_tokens {float(report.drafted_tokens)}" in text
    assert f"freetoken_spec_acceptance_rate {report.accepted_tokens / report.drafted_tokens}" in text


def test_offline_outputs_report_drafted_and_accepted(tiny_gemma, make_llm):
    out = make_llm(tiny_gemma, num_tokens=1024, **SPEC).generate(repeating(1), GREEDY)[0]
    assert 0 < out.accepted_tokens <= out.drafted_tokens
    plain = make_llm(tiny_gemma, num_tokens=1024).generate(repeating(1), GREEDY)[0]
    assert (plain.drafted_tokens, plain.accepted_tokens) == (0, 0) and plain.token_ids == out.token_ids


def test_config_refuses_bad_speculation_flags():
    from freetoken.errors import ConfigError

    for flags, flag in (({"speculative": "eagle"}, "--speculative"), ({"spec_max_draft": 0}, "--spec-max-draft"),
                        ({"spec_ngram_min": 3, "spec_ngram_max": 2}, "--spec-ngram-min")):
        with pytest.raises(ConfigError, match=flag):
            EngineConfig(**flags).validate()


@pytest.mark.real_model
def test_real_gemma_greedy_identical_with_speculation(real_gemma_loaded):
    """Gemma 3 270M (float32): a prompt it copies from and one it does not."""
    from freetoken.llm import LLM

    tok = real_gemma_loaded.tokenizer
    source = "\n".join(f"def f{i}(x):\n    return x * {i} + {i * 3}\n" for i in range(8))
    copy = tok.encode("Repeat the following file exactly.\n\n" + source + "\n\nThe file again:\n\n")
    fresh = tok.encode("Write a short poem about the sea and the wind.")
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)

    def run(**flags: object) -> tuple[list[list[int]], LLM]:
        config = EngineConfig(model="gemma3-270m", dtype="float32", page_size=16, num_tokens=4096,
                              max_running_requests=2, debug_kv=True, **flags)  # type: ignore[arg-type]
        llm = LLM(config=config, loaded=real_gemma_loaded)
        return generate(llm, [copy, fresh], params), llm

    plain, _ = run()
    spec, llm = run(**SPEC)
    assert spec == plain
    assert llm.engine.accepted_tokens > 0


def test_ngram_index_and_draft_window():
    """The lookup proposes what followed the latest earlier occurrence of the longest suffix
    n-gram; the window doubles after a whole acceptance and falls to j + 1 after a partial one."""
    from freetoken.engine.speculative import NgramIndex, Speculator, accepted

    req = Request("a", [1, 2, 3, 4, 9, 2, 3, 5, 6, 1, 2, 3], SamplingParams(max_tokens=40))
    req.output_ids = []
    index = NgramIndex(1, 3)
    index.update(req)
    assert index.lookup(req, 3) == [4, 9, 2]  # "1 2 3" occurred at the start, followed by 4 9 2
    req.output_ids = [7]  # "3 7" and "7" never occurred
    index.update(req)
    assert index.lookup(req, 3) == []
    req.output_ids = [7, 2, 3]  # "7 2 3" is new; "2 3" last occurred at the prompt's end, then 7 2 3
    index.update(req)
    assert index.lookup(req, 3) == [7, 2, 3]
    assert index.lookup(req, 8) == [7, 2, 3]  # the draft stops at the sequence's end
    assert accepted([5, 6, 1], [5, 6, 8, 0]) == 2 and accepted([5], [4, 0]) == 0 and accepted([5], [5, 9]) == 1

    spec = Speculator(max_draft=8, ngram_min=1, ngram_max=3)
    req.output_ids = [7, 2, 3]
    assert len(spec.propose(req)) == 3  # the window starts at 8; the sequence ends 3 tokens after the match
    spec.observe("a", 8, 8)
    assert spec._window["a"] == 8
    spec.observe("a", 8, 2)
    assert spec._window["a"] == 3
    spec.observe("a", 3, 3)
    assert spec._window["a"] == 6
    spec.observe("a", 6, 0)
    assert spec._window["a"] == 1 and len(spec.propose(req)) == 1
    short = Request("b", [1, 2, 1, 2], SamplingParams(max_tokens=3), output_ids=[1, 2])
    assert spec.propose(short) == []  # max_tokens - output - 1 = 0: nothing to draft
    spec.drop("a")
    assert "a" not in spec._window and "a" not in spec._indexes
