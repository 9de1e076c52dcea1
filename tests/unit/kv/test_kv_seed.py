"""The known failure (DESIGN.md §3) as deterministic tests, with its ablation rows.

A: a prompt several windows long, still running. B: a short prompt sharing A's first 5 tokens,
batched with A's last prefill chunk, committing its prompt beneath A's path while A holds it, then
decoding 2+ steps. Both finish in either order; the audit stays clean after every step and at
idle free + tree == capacity in both pools.
"""

from __future__ import annotations

import pytest

from freetoken.kv.manager import KVManager
from kv_sim import Sim

A_PROMPT = list(range(100, 148))  # 48 tokens: 6 windows of 8
CHUNK = 16


def make(page_size: int, window: int | None = 8, cache_type: str = "radix") -> Sim:
    swa = 96 if window is not None else None
    kv = KVManager(full_pages=96, swa_pages=swa, page_size=page_size, window=window,
                   cache_type=cache_type)
    return Sim(kv, chunk=CHUNK)


def head_swa_entries(sim: Sim, n: int) -> list[int]:
    """The tree's SWA entries for the first n tokens of A's path."""
    tree = sim.kv.tree
    entries = tree._walk(tuple(A_PROMPT), n // sim.kv.page_size + 1)
    return [node.swa[j] for node, j in entries][: max(1, n // sim.kv.page_size)]


def idle_balanced(sim: Sim) -> None:
    assert not sim.running
    sim.check()  # A1-A5 with idle=True
    tree = sim.kv.tree
    for pool in (sim.kv.full_pool, sim.kv.swa_pool):
        if pool is None:
            continue
        in_tree = tree.num_pages(pool.kind) if tree is not None else 0
        assert pool.num_free + in_tree == pool.capacity


def run_seed(sim: Sim, *, head: str, a_first: bool, b_max_tokens: int = 4,
             b_prompt: list[int] | None = None) -> None:
    a = sim.admit("A", A_PROMPT, max_tokens=6)
    assert a.cached == 0
    assert sim.step("A") and sim.step("A")  # two of A's three prefill chunks
    if head == "evicted":  # a forced SWA eviction pass tombstones everything A does not hold
        sim.kv.evict("swa", 10_000)
    b = sim.admit("B", b_prompt if b_prompt is not None else A_PROMPT[:5] + [7, 8, 9], b_max_tokens)
    if head in ("policy", "evicted") and b_prompt is None:
        assert b.cached == 0
        assert 0 in head_swa_entries(sim, 5)  # A's shared head is tombstoned in the tree
    assert sim.step("A", "B")  # B batched with A's last prefill chunk; A commits first
    assert sim.running["A"].computed == len(A_PROMPT)
    while not sim.running["B"].done:  # B decodes beside A
        assert sim.step("A", "B")
    order = ["A", "B"] if a_first else ["B", "A"]
    for rid in order:
        sim.finish(rid)
    idle_balanced(sim)


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("a_first", [True, False])
@pytest.mark.parametrize("head", ["policy", "evicted"])
def test_seed_head_tombstoned(page_size: int, a_first: bool, head: str) -> None:
    run_seed(make(page_size), head=head, a_first=a_first)


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("a_first", [True, False])
def test_seed_head_live(page_size: int, a_first: bool) -> None:
    sim = make(page_size, window=64)  # window wider than A's first chunks: nothing tombstoned
    sim.admit("A", A_PROMPT, max_tokens=6)
    assert sim.step("A")
    b = sim.admit("B", A_PROMPT[:5] + [7, 8, 9], 4)
    assert b.cached == (5 // page_size) * page_size  # B leases A's live head
    assert 0 not in head_swa_entries(sim, 5)
    while sim.running["A"].computed < len(A_PROMPT) or not sim.running["B"].done:
        assert sim.step(*[r for r in ("A", "B") if not sim.running[r].done])
    for rid in (["A", "B"] if a_first else ["B", "A"]):
        sim.finish(rid)
    idle_balanced(sim)


@pytest.mark.parametrize("page_size", [1, 4])
def test_b_committed_pages_become_the_trees_and_duplicates_return(page_size: int) -> None:
    """The mechanism: B's duplicate head pages are B's alone and free at B's release; B's own
    committed pages are the tree's and stay."""
    sim = make(page_size)
    run_seed(sim, head="policy", a_first=False)
    tree = sim.kv.tree
    assert all(sim.kv.full_pool.rc[p] == 1 for n in tree.nodes() for p in n.full)
    b_path = tree._walk(tuple(A_PROMPT[:5] + [7, 8, 9]), 8 // page_size)
    assert len(b_path) == 8 // page_size  # B's prompt is in the tree


# -- ablation rows of the reference report -------------------------------------------------


@pytest.mark.parametrize("page_size", [1, 4])
def test_ablation_b_max_tokens_1(page_size: int) -> None:
    run_seed(make(page_size), head="policy", a_first=True, b_max_tokens=1)


@pytest.mark.parametrize("page_size", [1, 4])
def test_ablation_b_shares_no_token(page_size: int) -> None:
    run_seed(make(page_size), head="none", a_first=True, b_prompt=[900, 901, 902, 903, 904, 905, 906, 907])


@pytest.mark.parametrize("page_size", [1, 4])
def test_ablation_b_after_a_finished(page_size: int) -> None:
    sim = make(page_size)
    sim.admit("A", A_PROMPT, 6)
    sim.run_to_end("A")
    sim.admit("B", A_PROMPT[:5] + [7, 8, 9], 4)
    sim.run_to_end("B")
    idle_balanced(sim)


@pytest.mark.parametrize("page_size", [1, 4])
def test_ablation_two_short_prompts(page_size: int) -> None:
    sim = make(page_size)
    sim.admit("A", A_PROMPT[:8], 4)
    sim.admit("B", A_PROMPT[:5] + [7, 8, 9], 4)
    while sim.running and not all(r.done for r in sim.running.values()):
        assert sim.step(*[r for r in sim.running if not sim.running[r].done])
    sim.finish("B")
    sim.finish("A")
    idle_balanced(sim)


@pytest.mark.parametrize("a_first", [True, False])
def test_ablation_naive_cache(a_first: bool) -> None:
    sim = make(1, cache_type="naive")
    assert sim.kv.tree is None
    run_seed(sim, head="none", a_first=a_first)
    assert sim.kv.full_pool.num_free == sim.kv.full_pool.capacity


@pytest.mark.parametrize("page_size", [1, 4])
def test_ablation_no_window_radix(page_size: int) -> None:
    run_seed(make(page_size, window=None), head="none", a_first=False)


@pytest.mark.parametrize("page_size", [1, 4])
def test_n_identical_prompts_same_step(page_size: int) -> None:
    sim = make(page_size)
    rids = [f"r{i}" for i in range(5)]
    for rid in rids:
        assert sim.admit(rid, A_PROMPT[:12], 3).cached == 0
    while not all(sim.running[r].done for r in rids):
        assert sim.step(*rids)
    finished = [sim.finish(rid) for rid in rids]
    idle_balanced(sim)
    # a follow-up over the committed sequence (prompt + output - 1 = 14 tokens) reuses all of it
    follow = finished[0].tokens + [5]
    assert sim.admit("again", follow, 1).cached == (14 // page_size) * page_size
