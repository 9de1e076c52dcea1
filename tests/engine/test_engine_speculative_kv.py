"""Speculative decoding's KV rule, "draft k, accept j", under the KV tests' content oracle.

The real engine with `--speculative ngram` runs over a null model whose greedy token is a
function of the last token and of the position (so n-gram drafts are often right and break
every few tokens: every j from 0 to k occurs) on small pools. Every KV manager call, the draft's
`extend_draft` and `accept` included, is followed by the shadow check (each holder holds the K/V
of the tokens it claims; every key a query reads is its own prefix's) and the full audit, A6
included. After every step the tree holds only real sequences: each root-to-node path is a
prefix of a request's prompt + output, so no rejected token ever reaches it. The seeded KV
programs of tests/unit/kv and a Hypothesis machine drive the traffic.
"""

from __future__ import annotations

import os
import random
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit" / "kv"))

from engine_sim import VOCAB, Setup, random_program
from spec_sim import DraftingRunner, SpecKV, Watch, next_token

from freetoken.config import EngineConfig
from freetoken.engine.engine import Engine
from freetoken.engine.scheduler import ScheduledItem
from freetoken.request import Request, SamplingParams


def make_spec_engine(setup: Setup, max_draft: int = 4) -> Engine:
    p = setup.page_size
    swa_tokens: int | str | None = None
    if setup.window is not None:
        swa_tokens = "floor" if setup.swa_pages is None else setup.swa_pages * p
    config = EngineConfig(
        model="null", page_size=p, max_running_requests=setup.max_running, max_prefill_length=setup.chunk,
        num_tokens=setup.full_pages * p, cache_type=setup.cache_type, debug_kv=True, swa_pool_tokens=swa_tokens,
        speculative="ngram", spec_max_draft=max_draft, spec_ngram_min=1, spec_ngram_max=3,
    )
    resolved = config.resolve(model_context_length=4096, window=setup.window, kv_bytes_per_token=1, available_bytes=1 << 30)
    kv = SpecKV(full_pages=resolved.full_pages, swa_pages=resolved.swa_pages, page_size=p, window=setup.window,
                cache_type=resolved.cache_type)
    return Engine(resolved, DraftingRunner(kv), kv, None)


def submit(engine: Engine, rid: str, prompt: list[int], max_tokens: int) -> Request:
    req = Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    engine.add_request(req)
    return req


def greedy_reference(prompt: list[int], max_tokens: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens))
    return tokens[len(prompt) :]


SETUPS = [Setup(1, 5, 64), Setup(4, 6, 24), Setup(4, None, 24), Setup(2, 7, 40, max_running=4, chunk=10),
          Setup(4, 3, 24, cache_type="naive")]


@pytest.mark.parametrize("setup", SETUPS, ids=str)
def test_draft_k_accept_j_outputs_and_kv(setup):
    """Concurrent greedy requests over a shared head: outputs equal the model's own greedy
    continuation, every j in 0..k occurs, the rejected tokens' pages go back."""
    engine = make_spec_engine(setup)
    watch = Watch(engine)
    rng = random.Random(7)
    head = [rng.randrange(VOCAB) for _ in range(12)]
    reqs = []
    for i in range(8):
        prompt = head[: rng.randrange(0, 13)] + [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 6))]
        reqs.append(submit(engine, f"r{i}", prompt, rng.randrange(4, 24)))
        watch.track(reqs)
        watch.step()
    watch.drain()
    for req in reqs:
        assert req.output_ids == greedy_reference(req.prompt_ids, req.params.max_tokens), req.rid
    counts = engine.kv.counts  # type: ignore[attr-defined]
    assert counts["draft"] > 0 and counts["rejected draft tokens"] > 0
    assert 0 < engine.accepted_tokens < engine.drafted_tokens


@pytest.mark.parametrize("seed", range(6))
def test_seeded_kv_programs_with_speculation(seed):
    """The KV tests' seeded programs (arrivals over shared prefixes, aborts, eviction passes,
    preemption on small pools) with drafting on."""
    setup, program = random_program(seed)
    engine = make_spec_engine(setup)
    watch = Watch(engine)
    engine_step = engine.step

    def step_and_check():  # the programs call engine.step() through engine_sim.step
        watch.track(list(engine.requests.values()))
        out = engine_step()
        watch.check_tree()
        return out

    engine.step = step_and_check  # type: ignore[method-assign]
    program(engine)
    assert engine.drafted_tokens > 0, f"seed {seed}: nothing was drafted"


def test_preempt_and_abort_while_a_verified_chunk_is_scheduled():
    """The scheduler has grown two requests' tables for their drafts; one is preempted and one
    aborted before the forward: the draft's pages go back with the rest, the others run on."""
    engine = make_spec_engine(Setup(4, 6, 48, max_running=3))
    watch = Watch(engine)
    reqs = [submit(engine, f"r{i}", [3, 9, 3, 9, 3, 9, 3 + i], 30) for i in range(3)]
    watch.track(reqs)
    items: list[ScheduledItem] = []
    for _ in range(40):
        watch.step()
        items = engine.scheduler.schedule()  # what the next step would run ...
        if sum(1 for it in items if it.draft) >= 2:
            break
        for it in items:  # ... not run: resolve the drafts as a chunk rejecting everything would
            if it.draft:
                engine.kv.accept(it.req.rid, it.req.num_computed)
    drafted = [it for it in items if it.draft]
    assert len(drafted) >= 2, "no two requests drafted at once"
    victim, aborted = drafted[0].req, drafted[1].req
    engine.scheduler.preempt(victim)
    engine.abort(aborted.rid)
    assert victim.rid not in engine.kv.request_ids and aborted.rid not in engine.kv.request_ids
    for it in items:  # the rest: resolved as if their chunk had rejected everything
        if it.draft and it.req.rid in engine.kv.request_ids:
            engine.kv.accept(it.req.rid, it.req.num_computed)
    watch.drain()
    for req in reqs:
        if req is not aborted:
            assert req.output_ids == greedy_reference(req.prompt_ids, 30), req.rid
    assert victim.preemptions == 1


def test_a_forgotten_accept_and_kept_rejected_pages_fail_a6():
    """The audit's rule A6 catches both ways of getting "draft k, accept j" wrong."""
    from freetoken.kv.manager import KVManager

    kv = KVManager(full_pages=16, swa_pages=16, page_size=2, window=3, cache_type="radix")
    kv.admit("a", [1, 2, 3])
    assert kv.extend("a", 3)
    kv.release_out_of_window("a", 3)
    assert kv.extend_draft("a", 3 + 1 + 5)  # the last token + 5 drafts: 5 pages
    assert kv.audit(idle=False).checks_failed() == {"A6"}  # pending
    kv.accept("a", 5)  # j = 1 accepted: positions 0..4 written, 3 pages kept
    kv.release_out_of_window("a", 5)
    assert kv.audit(idle=False).ok
    assert len(kv.page_tables("a")[0]) == 3
    kv._requests["a"].full.append(kv.full_pool.alloc(1)[0])  # a page kept past the written tokens
    kv._requests["a"].swa.append(kv.swa_pool.alloc(1)[0])
    assert "A6" in kv.audit(idle=False).checks_failed()


def _settings() -> settings:
    """Never derandomized (each run explores new programs; a failure prints its blob), as the KV
    tests' profile; the mixed driver (tests/unit/kv/test_kv_mixed.py) adds resizes and pins."""
    return settings(max_examples=8, stateful_step_count=30, deadline=None, derandomize=False, print_blob=True,
                    database=None if os.environ.get("CI") else settings.default.database,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


class SpecMachine(RuleBasedStateMachine):
    """Arrivals (repetitive and not), steps and aborts with drafting on; k varies per machine."""

    @initialize(setup=st.sampled_from(SETUPS), max_draft=st.integers(1, 6))
    def start(self, setup: Setup, max_draft: int) -> None:
        self.engine = make_spec_engine(setup, max_draft)
        self.watch = Watch(self.engine)
        self.serial = 0
        self.cap = self.engine.config.full_pages * setup.page_size

    @rule(loop=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=4), times=st.integers(1, 4),
          tail=st.lists(st.integers(0, VOCAB - 1), max_size=6), max_tokens=st.integers(1, 16))
    def arrive(self, loop, times, tail, max_tokens) -> None:
        prompt = loop * times + tail
        if len(prompt) + max_tokens > self.cap // 2:
            return
        self.serial += 1
        self.watch.track([submit(self.engine, f"r{self.serial}", prompt, max_tokens)])

    @precondition(lambda self: self.engine.has_work())
    @rule(n=st.integers(1, 4))
    def run_steps(self, n: int) -> None:
        for _ in range(n):
            self.watch.step()

    @precondition(lambda self: self.engine.requests)
    @rule(data=st.data())
    def abort(self, data) -> None:
        self.engine.abort(data.draw(st.sampled_from(sorted(self.engine.requests))))
        self.watch.step()

    def teardown(self) -> None:
        if hasattr(self, "engine"):
            self.watch.drain()
            for req in self.watch.seen.values():
                if req.finish_reason is not None and req.finish_reason.value == "length":
                    assert req.output_ids == greedy_reference(req.prompt_ids, req.params.max_tokens)


SpecMachine.TestCase.settings = _settings()
TestSpeculativeKVMachine = SpecMachine.TestCase
