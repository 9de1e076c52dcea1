"""The known failure (DESIGN.md §3) and its ablation rows through the real engine over a null
model, with the shadow check and the audit after every KV call. Each seed row asserts its own
preconditions, so a change that stops reaching the dangerous sequence fails here instead of
passing vacuously: A's shared head is a tombstone A holds when B arrives, B's hit is 0, B
decodes at least two tokens while A is in flight, and B commits its own pages beneath that
tombstone while A holds it (the key step)."""

from __future__ import annotations

import pytest

from seed_rows import ABLATION_ROWS, SEED_ROWS, Row, run_row

KEY_STEP = "commit beneath a tombstone another request holds"


@pytest.mark.parametrize("row", SEED_ROWS, ids=lambda r: r.name)
def test_seed_row_is_clean_and_reaches_the_key_step(row: Row) -> None:
    facts = run_row(row)
    assert facts.b is not None and len(facts.b.output_ids) == row.b_max
    assert len(facts.a.output_ids) == row.a_max
    assert facts.head_tombstoned_and_held, "A's shared head must be a tombstone A holds"
    assert facts.b.report.cached_tokens == 0, "the window rule must refuse B's tombstoned head"
    assert facts.b_decodes_beside_a >= 2, "B must decode at least two tokens beside A"
    if row.key_step:
        assert facts.kv.counts[KEY_STEP] >= 1, "B's pages must be committed beneath A's tombstone"


@pytest.mark.parametrize("row", ABLATION_ROWS, ids=lambda r: r.name)
def test_ablation_row_is_clean(row: Row) -> None:
    facts = run_row(row)
    if facts.b is not None:
        assert len(facts.b.output_ids) == row.b_max
    assert len(facts.a.output_ids) == row.a_max


def test_b_pages_become_the_trees_and_duplicates_return() -> None:
    """The mechanism FreeToken relies on: after the seed row, every tree page is the tree's
    alone (rc 1), B's prompt is in the tree, and B's duplicate head pages went back."""
    facts = run_row(SEED_ROWS[0])
    kv = facts.kv
    assert kv.tree is not None
    assert all(kv.full_pool.rc[p] == 1 for n in kv.tree.nodes() for p in n.full)
    b_prompt = SEED_ROWS[0].b_prompt
    assert len(kv.tree._walk(tuple(b_prompt), len(b_prompt))) == len(b_prompt)
    tree_pages = kv.tree.num_pages("full")
    assert kv.full_pool.num_free + tree_pages == kv.full_pool.capacity
