"""Prefix hits on Qwen3.5 / Qwen3.5-MoE through recurrent-state snapshots (kv/tree.py), through the
engine on tiny random weights, every hit's greedy tokens checked against transformers' generate
on the whole prompt (a hit that started from a wrong state would give other tokens: the negative
control shows it does), with the audit after every step (`--debug-kv`):

- a resent prompt hits at its cap (prompt chunks end there, so the state is snapshotted there);
- a conversation, each request extending the last with marked message boundaries, hits at the
  last page boundary the previous request's state passed (a decode step's snapshot, in its reply);
- two conversations over one system prompt hit at its end; a prefix seen forked once (no mark)
  hits at the fork;
- with few state slots, snapshots are evicted (LRU) and an evicted one is a `state_missing` miss;
  the pool balances at idle (free + the tree's snapshots == capacity);
- a run-time resize of the state pool keeps the snapshots that fit, with their states.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import transformers

from freetoken.config import EngineConfig
from freetoken.kv.miss import path_tokens
from freetoken.kv.snapshots import eviction_order, snapshot_at
from freetoken.llm import LLM
from freetoken.request import Request, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_models import write_tiny_model  # noqa: E402

NEW = 6
PARAMS = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
SYSTEM = list(range(3, 16))  # 13 tokens: a snapshot at 12 (the boundary floored to a page of 4)


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_5_moe"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(request.param, Path(tmp_path_factory.mktemp(request.param)))


@pytest.fixture(scope="module")
def oracle(checkpoint: Path):  # noqa: ANN201 - a callable: prompt -> transformers' greedy tokens
    model = transformers.AutoModelForCausalLM.from_pretrained(
        checkpoint, dtype=torch.float64, attn_implementation="eager"
    )
    model.config._experts_implementation = "eager"

    def greedy(prompt: list[int]) -> list[int]:
        gen = model.generate(
            torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0
        )
        return gen[0, len(prompt) :].tolist()

    return greedy


def engine(checkpoint: Path, chunk: int = 16, **overrides: object) -> LLM:
    config = EngineConfig(model=str(checkpoint), dtype="float64", page_size=4, max_prefill_length=chunk,
                          num_tokens=1024, debug_kv=True, threads=1, **overrides)  # fmt: skip
    return LLM(str(checkpoint), config=config)


def run(llm: LLM, rid: str, prompt: list[int], boundaries: tuple[int, ...] = ()) -> Request:
    req = Request(rid, prompt, PARAMS, boundaries=boundaries)
    llm.engine.add_request(req)
    while llm.engine.has_work():
        llm.engine.step()
    return req


def balanced(llm: LLM) -> bool:
    kv = llm.engine.kv
    return kv.state_pool.num_free + kv.tree.num_pages("state") == kv.state_pool.capacity and kv.audit(idle=True).ok


def test_resent_prompt_hits_at_its_cap(checkpoint: Path, oracle) -> None:  # noqa: ANN001
    prompt = list(range(3, 40))  # 37 tokens: the cap is 36
    want = oracle(prompt)
    llm = engine(checkpoint)
    first = run(llm, "a", prompt)
    again = run(llm, "b", prompt)
    assert first.output_ids == again.output_ids == want
    assert (again.report.cached_tokens, again.report.miss_reason) == (36, "capped")
    assert balanced(llm)


def test_without_the_copy_the_hit_gives_other_tokens(checkpoint: Path, oracle) -> None:  # noqa: ANN001
    """The negative control: the same resend with the hit's state copy switched off starts from
    the stale state its slot held, and transformers' tokens catch it."""
    prompt = list(range(3, 40))
    llm = engine(checkpoint)
    run(llm, "a", prompt)
    kv = llm.engine.kv
    real = kv.copy_state
    kv.copy_state = lambda src, dst: real(src, dst) if kv.tree.owned("state").get(dst) else None  # snapshots only
    again = run(llm, "b", prompt)
    assert again.report.cached_tokens == 36
    assert again.output_ids != oracle(prompt)


def test_conversation_hits_in_the_previous_requests_reply(checkpoint: Path, oracle) -> None:  # noqa: ANN001
    llm = engine(checkpoint)
    p1 = SYSTEM + list(range(40, 64))  # 37 tokens: system 13, user 24
    t1 = run(llm, "t1", p1, boundaries=(13, 37))
    assert t1.output_ids == oracle(p1)
    p2 = p1 + t1.output_ids + list(range(70, 80))  # + assistant 6, user 10: 53 tokens
    t2 = run(llm, "t2", p2, boundaries=(13, 37, 43, 53))
    assert t2.output_ids == oracle(p2)
    assert t2.report.cached_tokens == 40  # the last page boundary t1's state passed: in its reply
    p3 = p2 + t2.output_ids + list(range(90, 97))
    t3 = run(llm, "t3", p3, boundaries=(13, 37, 43, 53, 59, len(p3)))
    assert t3.output_ids == oracle(p3)
    assert t3.report.cached_tokens == 56  # the same in t2's reply (53 + 3)
    assert balanced(llm)


def test_conversations_over_one_system_prompt_hit_at_its_end_and_a_fork_hits_at_the_fork(
    checkpoint: Path,
    oracle,  # noqa: ANN001
) -> None:
    llm = engine(checkpoint, chunk=64)
    a = SYSTEM + list(range(200, 215))
    b = SYSTEM + list(range(300, 311))
    run(llm, "a", a, boundaries=(13, len(a)))
    rb = run(llm, "b", b, boundaries=(13, len(b)))
    assert rb.output_ids == oracle(b)
    assert rb.report.cached_tokens == 12
    x = list(range(100, 130))  # no marks: one chunk to its cap (28), the only snapshot
    run(llm, "x", x)
    y = x[:16] + list(range(250, 260))
    ry = run(llm, "y", y)
    assert (ry.report.cached_tokens, ry.report.miss_reason) == (0, "state_missing")  # pages to 16, no state
    z = x[:16] + list(range(270, 279))
    rz = run(llm, "z", z)
    assert rz.report.cached_tokens == 16  # y's chunk ended where its path left the tree's
    assert (ry.output_ids, rz.output_ids) == (oracle(y), oracle(z))
    assert balanced(llm)


def test_snapshots_evicted_under_pressure_and_the_pool_balances(checkpoint: Path, oracle) -> None:  # noqa: ANN001
    """One running request and no extra snapshot slot: 3 state slots, so at most 2 snapshots
    beside the running request's slot; older ones are evicted, a resend of the newest prompt
    hits and one of the oldest misses on the state."""
    llm = engine(checkpoint, max_running_requests=1, state_snapshots=0)
    kv = llm.engine.kv
    assert kv.state_pool.capacity == 3
    prompts = [[k + 1] + list(range(100 + 20 * k, 117 + 20 * k)) for k in range(4)]  # 18 tokens: one snapshot at 16
    for k, p in enumerate(prompts):
        assert run(llm, f"p{k}", p).output_ids == oracle(p)
    assert kv.tree.num_pages("state") == 2 and kv.tree.num_pages("full") == 4 * 5  # 23 tokens written each
    last = run(llm, "last", prompts[-1])
    first = run(llm, "first", prompts[0])
    assert (last.report.cached_tokens, first.report.cached_tokens) == (16, 0)
    assert first.report.miss_reason == "state_missing"
    assert (last.output_ids, first.output_ids) == (oracle(prompts[-1]), oracle(prompts[0]))
    assert balanced(llm)


def test_a_snapshot_holds_the_state_a_cold_run_reaches_there(checkpoint: Path) -> None:
    """Tensor level: the snapshot at 36 of a 37-token prompt prefilled in chunks of 16 equals,
    layer by layer, the state of another engine that prefilled exactly those 36 tokens in chunks
    of 64 (its finish commit snapshots there)."""

    def snapshot_states(llm: LLM, prompt: list[int], end: int) -> list[torch.Tensor]:
        kv, tensors = llm.engine.kv, llm.engine.runner.kv_tensors
        slot = snapshot_at(kv.tree, tuple(prompt), end)
        assert slot
        return [t[slot].clone() for t in (*tensors.conv, *tensors.recurrent) if t is not None]

    prompt = list(range(3, 40))
    chunked = engine(checkpoint, chunk=16)
    run(chunked, "a", prompt)
    whole = engine(checkpoint, chunk=64)
    req = Request("b", prompt[:36], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    whole.engine.add_request(req)
    while whole.engine.has_work():
        whole.engine.step()
    got, want = snapshot_states(chunked, prompt, 36), snapshot_states(whole, prompt, 36)
    assert len(got) == len(want) == 2 * sum(chunked.engine.runner.kv_tensors.linear)  # conv + recurrent per layer
    assert any(bool(w.abs().max() > 0) for w in want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-10)


def test_seed_scenario_on_the_hybrid_model(checkpoint: Path) -> None:
    """tests/engine/test_engine_seed.py's pattern (DESIGN.md §3, "Known failure") without SWA: A
    (40 tokens, chunks of 12) still running; B shares A's first 5 tokens and is admitted in the
    step of A's last prefill chunk, commits its own prompt beneath the head A holds (its chunk
    ends at the branch point, 4, and snapshots there) and decodes beside A. Audit after every
    step; both give transformers' tokens; pages and state slots balance at idle."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        checkpoint, dtype=torch.float64, attn_implementation="eager"
    )
    model.config._experts_implementation = "eager"

    def greedy(prompt: list[int], n: int) -> list[int]:
        gen = model.generate(
            torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0
        )
        return gen[0, len(prompt) :].tolist()

    a_prompt = [10 + (i * 37) % 300 for i in range(40)]
    b_prompt = a_prompt[:5] + [301 + i for i in range(11)]
    llm = engine(checkpoint, chunk=12)
    eng = llm.engine
    a = Request("A", a_prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    b = Request("B", b_prompt, PARAMS)
    eng.add_request(a)
    while a.num_computed < 36:
        eng.step()
    eng.add_request(b)
    b_beside_a = 0
    while eng.has_work():
        eng.step()
        if a.finish_reason is None:
            b_beside_a = len(b.output_ids)
    assert b_beside_a >= 2
    assert snapshot_at(eng.kv.tree, tuple(b_prompt), 4)  # B's branch point
    assert (a.output_ids, b.output_ids) == (greedy(a_prompt, 12), greedy(b_prompt, NEW))
    assert balanced(llm)


def test_chat_conversations_rendered_by_the_template_hit_at_the_system_message(checkpoint: Path, oracle) -> None:  # noqa: ANN001
    """The boundaries the server marks (`render_chat`: the end of each message) reach the
    snapshot points: a second conversation over the same system message hits at its end,
    floored to a page, and gives transformers' tokens."""
    from freetoken.server.core.chat_prompt import render_chat

    llm = engine(checkpoint, chunk=64)
    system = {"role": "system", "content": "You are a careful agent. " * 8}
    got = []
    for i, user in enumerate(["list the files", "read the readme"]):
        ids, bounds = render_chat(llm.tokenizer, [system, {"role": "user", "content": user}])
        got.append((run(llm, f"c{i}", ids, bounds), ids, bounds))
    (_, _, first_bounds), (second, ids, bounds) = got
    assert bounds[0] == first_bounds[0]  # where the system message ends
    assert second.report.cached_tokens == bounds[0] - bounds[0] % 4
    assert second.output_ids == oracle(ids)
    assert balanced(llm)


def test_a_state_pool_resize_keeps_the_snapshots_it_can_with_their_states(checkpoint: Path, oracle) -> None:  # noqa: ANN001
    """A shrink of the state pool (`Engine.resize(state_slots=...)`) keeps the snapshots that fit
    below its new size (the last ones in the eviction order), each moved there with its state
    (tensor for tensor), the tensors shrink to it, and a resend hits a moved snapshot with
    transformers' tokens; a grow adds zero slots."""
    llm = engine(checkpoint, max_running_requests=1, state_snapshots=6)
    kv, tensors = llm.engine.kv, llm.engine.runner.kv_tensors
    assert kv.state_pool.capacity == 9
    prompts = [[k + 1] + list(range(100 + 20 * k, 117 + 20 * k)) for k in range(6)]  # snapshots at 16 and 20
    for k, p in enumerate(prompts):
        run(llm, f"p{k}", p)

    def states() -> dict[tuple[int, ...], list[torch.Tensor]]:
        """The path of each snapshot -> its states, layer by layer."""
        out = {}
        for slot, node in kv.tree.owned("state").items():
            end = node.start + (node.state.index(slot) + 1) * 4
            key = tuple(path_tokens(node)[:end])
            out[key] = [t[slot].clone() for t in (*tensors.conv, *tensors.recurrent) if t is not None]
        return out

    before = states()
    assert len(before) > 4 and max(kv.tree.owned("state")) > 4
    order = eviction_order(kv.tree, pinned_too=True)
    owned = kv.tree.owned("state")
    kept = {tuple(path_tokens(owned[s])[: owned[s].start + (owned[s].state.index(s) + 1) * 4]) for s in order[-4:]}
    assert llm.engine.resize(state_slots=4) == {"state": {"capacity": 4, "pending_release": 0}}
    assert kv.state_pool.capacity == tensors.state_slots == 4 and tensors.conv[0].shape[0] == 5
    after = states()
    assert set(after) == kept and tuple(prompts[-1][:16]) in after  # the newest go last
    for key, got in after.items():
        for g, w in zip(got, before[key]):
            torch.testing.assert_close(g, w, rtol=0, atol=0)
    again = run(llm, "again", prompts[-1])
    assert (again.report.cached_tokens, again.output_ids) == (16, oracle(prompts[-1]))
    assert llm.engine.resize(state_slots=8)["state"]["capacity"] == 8
    assert tensors.state_slots == 8 and all(bool((t[5:] == 0).all()) for t in tensors.recurrent if t is not None)
    run(llm, "more", prompts[0] + [5, 6])
    assert balanced(llm)
