"""Negative controls: inject the defects the KV core exists to rule out and show that the
checks catch each one (a check that cannot fail proves nothing).

The first is the reference engine's actual defect (reference report 000), injected into the
real engine's KV manager (`seed_rows.ReferenceDefect`): it must fail exactly the seed rows and
pass every ablation row the reference survives. A control of the control shows that the
reference's commit points and its no-heal rule alone (`ReferenceCommits`) break nothing: what
kills the seed rows is the finish-time free of the tree's own pages.
"""

from __future__ import annotations

import pytest

from freetoken.kv.errors import KVIntegrityError
from freetoken.kv.manager import KVManager
from kv_sim import Sim
from seed_rows import ABLATION_ROWS, SEED_ROWS, ReferenceCommits, ReferenceDefect, Row, run_row
from shadow import ShadowViolation


def make(page_size: int) -> Sim:
    kv = KVManager(full_pages=96, swa_pages=96, page_size=page_size, window=8, cache_type="radix")
    return Sim(kv, chunk=16)


@pytest.mark.parametrize("row", SEED_ROWS, ids=lambda r: r.name)
def test_reference_defect_fails_every_seed_row(row: Row) -> None:
    with pytest.raises(ShadowViolation) as info:
        run_row(row, ReferenceDefect)
    text = str(info.value)
    # the first check to see it: A1 on a page the tree still names, freed under it
    assert "[A1] full page" in text and "rc=0" in text and "holders=[tree node#" in text


def test_reference_defect_frees_pages_the_tree_still_holds() -> None:
    """The reference's signature: right after B's release, pages are both free and named by
    the tree (there: free + tree = capacity + 4), and they are B's own committed pages."""
    kv_seen: list[ReferenceDefect] = []

    class Watched(ReferenceDefect):
        def __init__(self, **kwargs: object) -> None:
            super().__init__(**kwargs)
            kv_seen.append(self)

    with pytest.raises(ShadowViolation):
        run_row(SEED_ROWS[0], Watched)
    kv = kv_seen[0]
    assert kv.refused >= 1  # B's unfinished commit was refused by the window rule
    assert kv.tree is not None
    both = set(kv.full_pool.free_pages()) & set(kv.tree._full_at)
    assert len(both) >= 3  # B's own prompt pages [5, 8) at least
    assert {kv.tree._full_at[p].start for p in both} >= {5}


@pytest.mark.parametrize("row", ABLATION_ROWS, ids=lambda r: r.name)
def test_reference_defect_passes_every_ablation_row(row: Row) -> None:
    run_row(row, ReferenceDefect)


@pytest.mark.parametrize("row", SEED_ROWS + ABLATION_ROWS, ids=lambda r: r.name)
def test_reference_commit_points_alone_are_harmless(row: Row) -> None:
    run_row(row, ReferenceCommits)


@pytest.mark.parametrize("page_size", [1, 4])
def test_double_decref_on_shared_page_is_caught(page_size: int) -> None:
    sim = make(page_size)
    prompt = list(range(40, 40 + 4 * page_size))
    sim.admit("A", prompt, 3)
    assert sim.step("A")
    page = sim.kv.page_tables("A")[0][0]
    assert sim.kv.full_pool.rc[page] == 2  # held by A's table and by the tree
    sim.kv.full_pool.decref([int(page)])
    sim.kv.full_pool.decref([int(page)])  # the bug: one holder released twice; rc hits 0
    report = sim.kv.audit(idle=False)
    assert not report.ok
    v = next(v for v in report.violations if v.check == "A1" and v.page == page)
    assert v.refcount == 0
    assert any(h.startswith("request A") for h in v.holders)
    assert any(h.startswith("tree node") for h in v.holders)
    # and the next legitimate release trips the checked decref instead of freeing it twice
    with pytest.raises(KVIntegrityError) as info:
        sim.kv.release("A")
    assert info.value.report.page == page and info.value.report.check == "decref"


def test_release_is_idempotent_and_cannot_double_free() -> None:
    sim = make(1)
    sim.admit("A", list(range(20)), 1)
    sim.step("A")
    sim.finish("A")
    sim.kv.release("A")  # second release: no-op
    sim.check()


def test_report_pages_for_quarantine() -> None:
    sim = make(1)
    sim.admit("A", list(range(8)), 2)
    sim.step("A")
    page = int(sim.kv.page_tables("A")[0][0])
    sim.kv.full_pool.decref([page])
    sim.kv.full_pool.decref([page])
    report = sim.kv.audit(idle=False)
    with pytest.raises(KVIntegrityError) as info:
        report.raise_if_failed()
    pages = info.value.pages()
    assert page in pages["full"]
    holders = sim.kv.quarantine("full", pages["full"])
    assert holders == {"A"}
    sim.kv.release("A")  # ending the holder is safe: the quarantined page is never freed
    sim.running.clear()
    assert sim.kv.audit(idle=True).ok
    st = sim.kv.status()
    assert st["pools"]["full"]["quarantined"] == 1
    assert st["integrity"]["violations"] == 1 and not st["integrity"]["ok"]
    assert page not in sim.kv.full_pool.free_pages()
