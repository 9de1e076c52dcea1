"""The failure of the engine FreeToken replaces (DESIGN.md §3, "Known failure"), through the
engine, reaching its key step and proving that it did.

A is long (several windows) and still running; B shares A's first 5 tokens, arrives while A
prefills and is admitted in the step of A's last prefill chunk. The sizes are chosen so that
this step reaches the reference's fatal commit: A's last chunk is 4 tokens, which leaves B 8 of
the 12-token budget, so B's chunk covers the shared head *and* some of B's own prompt without
sampling, and the engine commits it -- B's own prompt goes into the tree beneath A's head while
A holds that head. B then decodes at least two tokens beside A.

A spy on `kv.commit` records the state at the moment of B's first commit, and every row asserts
its own preconditions there (head tombstoned or live as the row says, B's hit, B's own pages
committed under the head node, A holding the head) instead of trusting the arithmetic above.
The audit runs after every step (`debug_kv`), and the pools balance at idle.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from freetoken.config import EngineConfig
from freetoken.engine.build import build_engine_for
from freetoken.engine.engine import Engine
from freetoken.request import Request, RequestStatus, SamplingParams

CHUNK = 12  # --max-prefill-length: one budget shared by every prefill chunk of a step
A_PROMPT = [10 + (i * 37) % 300 for i in range(40)]  # 40 = 3 * 12 + 4: A's last chunk leaves B 8 tokens
SHARED = 5
B_PROMPT = A_PROMPT[:SHARED] + [301 + i for i in range(11)]  # 16 tokens: B's first chunk never samples
A_MAX = 12


@dataclass
class SeedRun:
    a: Request
    b: Request
    b_tokens_while_a_ran: int = 0  # B's output length at the last step after which A still ran
    at_b_commit: dict[str, object] = field(default_factory=dict)  # state at B's first commit


def head_entries(engine: Engine, tokens: list[int], pages: int) -> list[tuple[object, int]]:
    assert engine.kv.tree is not None
    return engine.kv.tree._walk(tuple(tokens), pages)  # (node, index) per page that exists


def spy_on_b_commit(engine: Engine, run: SeedRun, head_pages: int) -> None:
    """Wrap `kv.commit` to record, at B's first commit, the head's tree entries before it and
    where B's own pages landed after it."""
    real = engine.kv.commit
    kv = engine.kv

    def commit(rid: str, tokens: list[int], boundaries: tuple[int, ...] = (), resend_at: int | None = None) -> None:
        first_b = rid == "B" and not run.at_b_commit
        if first_b:
            before = head_entries(engine, run.b.prompt_ids, head_pages)
            a_tables = kv._requests.get("A")
            run.at_b_commit.update(
                committed=len(tokens) // kv.page_size * kv.page_size,
                b_has_output=bool(run.b.output_ids),
                b_cached_len=kv._requests["B"].cached_len,
                a_running=run.a.status is RequestStatus.RUNNING and a_tables is not None,
                a_prompt_done=run.a.num_computed >= len(run.a.prompt_ids) and len(run.a.output_ids) == 1,
                head_in_tree=len(before) == head_pages,
                head_swa_live=[n.swa[j] != 0 for n, j in before],
                head_full=[n.full[j] for n, j in before],
                a_holds_head=a_tables is not None and a_tables.full[:head_pages] == [n.full[j] for n, j in before],
            )
        real(rid, tokens, boundaries, resend_at)
        if first_b:
            n_pages = run.at_b_commit["committed"] // kv.page_size  # type: ignore[operator]
            after = head_entries(engine, run.b.prompt_ids, n_pages)
            b_full = kv._requests["B"].full
            whole_head = len(after) >= head_pages
            head_node = (after[head_pages - 1][0] if head_pages else kv.tree.root) if whole_head else None  # type: ignore[union-attr]
            own = after[head_pages:] if whole_head else []
            run.at_b_commit.update(
                path_after=len(after),
                own_pages_are_bs=bool(own) and [n.full[j] for n, j in own] == b_full[head_pages:n_pages],
                own_beneath_head=bool(own) and own[0][0].parent is head_node and own[0][0] is not head_node,
                head_full_after=[n.full[j] for n, j in after[:head_pages]],
            )

    engine.kv.commit = commit  # type: ignore[method-assign]


def run_overlap(
    engine: Engine,
    b_prompt: list[int],
    b_max: int,
    *,
    a_prompt: list[int] = A_PROMPT,
    b_after_a: bool = False,
    a_boundaries: tuple[int, ...] = (),
    evict_before_b: bool = False,
    head_pages: int = 0,
) -> SeedRun:
    """A, then B once A has one prefill chunk left (or once A finished); step to idle."""
    a = Request("A", list(a_prompt), SamplingParams(max_tokens=A_MAX, temperature=0.0, ignore_eos=True),
                boundaries=a_boundaries)
    b = Request("B", list(b_prompt), SamplingParams(max_tokens=b_max, temperature=0.0, ignore_eos=True))
    run = SeedRun(a, b)
    if engine.kv.tree is not None:
        spy_on_b_commit(engine, run, head_pages)
    engine.add_request(a)
    chunk = engine.config.engine.max_prefill_length
    b_added = False
    while engine.has_work() or not b_added:
        if not b_added and (a.finished if b_after_a else len(a.prompt_ids) - a.num_computed <= chunk):
            if evict_before_b:
                engine.kv.evict("swa", engine.config.swa_pages or 0)  # every SWA entry no request holds
            engine.add_request(b)
            b_added = True
        engine.step()
        if not a.finished:
            run.b_tokens_while_a_ran = len(b.output_ids)
    return run


def balanced_at_idle(engine: Engine) -> None:
    status = engine.status()
    assert status["integrity"]["violations"] == 0
    for pool in status["pools"].values():
        assert pool["in_use"] == 0
        assert pool["free"] + pool["cached"] == pool["capacity"]
    report = engine.kv.audit(idle=True)
    assert report.ok, str(report)


def engine_for(model, **flags) -> Engine:
    base = dict(model="tiny", dtype="float64", page_size=1, num_tokens=400, max_running_requests=4,
                max_prefill_length=CHUNK, debug_kv=True)
    base.update(flags)
    return build_engine_for(EngineConfig(**base), model)


def assert_key_step(run: SeedRun, *, head_pages: int, page_size: int, head_live: bool, b_hit: int) -> None:
    """The seed's key step happened: B's own prompt was committed beneath A's head (tombstoned
    or live, as the row says) in the step of A's last chunk, while A held the head."""
    s = run.at_b_commit
    assert s, "B never committed before its finish: the key step was not reached"
    assert not s["b_has_output"], "B's first commit must be a prefill chunk (its own prompt), not its finish"
    assert s["a_running"] and s["a_prompt_done"], "B's chunk must share the step of A's last prefill chunk"
    assert s["b_cached_len"] == b_hit and run.b.report.cached_tokens == b_hit, s
    assert s["head_in_tree"] and s["a_holds_head"], s
    assert s["head_swa_live"] == [head_live] * head_pages, s
    assert s["committed"] > head_pages * page_size, "B's commit must reach past the head into B's own prompt"
    assert s["own_pages_are_bs"] and s["own_beneath_head"], s
    assert s["head_full_after"] == s["head_full"], "the head keeps A's full pages"
    assert run.b_tokens_while_a_ran >= 2, "B must decode at least two tokens while A runs"


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("b_max", [2, 4, 8])
def test_seed_commit_beneath_tombstoned_head(tiny_gemma, page_size, b_max):
    """The reference's fatal row: A's head is out of the window (a tombstone by the commit
    policy), so B's hit is 0 and B commits its own prompt beneath it."""
    engine = engine_for(tiny_gemma, page_size=page_size)
    head_pages = SHARED // page_size
    run = run_overlap(engine, B_PROMPT, b_max, head_pages=head_pages)
    assert_key_step(run, head_pages=head_pages, page_size=page_size, head_live=False, b_hit=0)
    assert run.b.finished and not run.b.error and len(run.b.output_ids) == b_max
    assert len(run.a.output_ids) == A_MAX
    balanced_at_idle(engine)


@pytest.mark.parametrize("page_size", [1, 4])
def test_seed_head_tombstoned_by_forced_eviction(tiny_gemma, page_size):
    """A marks the head's end (as a chat message would), so the commit policy keeps the head
    live; a forced SWA eviction pass just before B arrives tombstones it again."""
    engine = engine_for(tiny_gemma, page_size=page_size)
    head_pages = SHARED // page_size
    run = run_overlap(engine, B_PROMPT, 4, a_boundaries=(head_pages * page_size,), evict_before_b=True,
                      head_pages=head_pages)
    assert_key_step(run, head_pages=head_pages, page_size=page_size, head_live=False, b_hit=0)
    balanced_at_idle(engine)


@pytest.mark.parametrize("page_size", [1, 4])
def test_seed_commit_beneath_live_head(tiny_gemma, page_size):
    """The same step with A's head live (A marked its end): B hits the head and commits its
    own prompt beneath it while A holds it."""
    engine = engine_for(tiny_gemma, page_size=page_size)
    head_pages = SHARED // page_size
    run = run_overlap(engine, B_PROMPT, 4, a_boundaries=(head_pages * page_size,), head_pages=head_pages)
    assert_key_step(run, head_pages=head_pages, page_size=page_size, head_live=True, b_hit=head_pages * page_size)
    balanced_at_idle(engine)


@pytest.mark.parametrize(
    "name,b_prompt,b_max,after",
    [
        ("b_max_tokens_1", B_PROMPT, 1, False),
        ("b_shares_a_long_prefix", A_PROMPT[:30] + [301, 302], 4, False),
        ("b_shares_nothing", [301 + i for i in range(16)], 4, False),
        ("b_after_a", B_PROMPT, 4, True),
    ],
)
def test_seed_ablation_rows(tiny_gemma, name, b_prompt, b_max, after):
    engine = engine_for(tiny_gemma)
    run = run_overlap(engine, b_prompt, b_max, b_after_a=after)
    assert run.a.finished and run.b.finished and len(run.b.output_ids) == b_max
    if name == "b_max_tokens_1":
        assert run.at_b_commit["a_prompt_done"] and run.b_tokens_while_a_ran == 1  # B ends beside A, never decodes on
    if after:
        assert run.b_tokens_while_a_ran == 0 and not run.at_b_commit["a_running"]  # B runs alone
    balanced_at_idle(engine)


def test_seed_two_short_prompts(tiny_gemma):
    engine = engine_for(tiny_gemma)
    run = run_overlap(engine, [7, 8, 9, 10, 11, 12], 4, a_prompt=[7, 8, 9, 10, 11, 13, 14])
    assert run.a.finished and run.b.finished
    balanced_at_idle(engine)


def test_seed_with_naive_cache(tiny_gemma):
    engine = engine_for(tiny_gemma, cache_type="naive")
    run = run_overlap(engine, B_PROMPT, 4)
    assert run.b_tokens_while_a_ran >= 2 and run.b.report.cached_tokens == 0
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
    """Gemma 3 270M (window 512, page 16, chunks of 1024 so that A's first commit tombstones its
    head): A is one chunk + 992 tokens, so B gets 32 tokens of A's last step; B shares one whole
    page (and 4 more tokens) with A, and its first chunk reaches into its own prompt."""
    page, chunk = 16, 1024
    config = EngineConfig(model="gemma3-270m", dtype="float32", page_size=page, num_tokens=4096, max_running_requests=4,
                          max_prefill_length=chunk, debug_kv=True)
    engine = build_engine_for(config, real_gemma_loaded)
    tok = real_gemma_loaded.tokenizer
    a_prompt = tok.encode(" ".join(f"word{i}" for i in range(900)))[: chunk + 992]
    assert len(a_prompt) == chunk + 992
    b_prompt = a_prompt[:20] + tok.encode(" probe" * 28, add_special_tokens=False)[:28]
    assert len(b_prompt) == 48 and b_prompt[20] != a_prompt[20]
    run = run_overlap(engine, b_prompt, 4, a_prompt=a_prompt, head_pages=1)
    assert_key_step(run, head_pages=1, page_size=page, head_live=False, b_hit=0)
    balanced_at_idle(engine)
