"""Negative controls: inject the defects the KV core exists to rule out and show that the
checked transfers or the audit catch each one (a check that cannot fail proves nothing)."""

from __future__ import annotations

import pytest

from freetoken.kv.errors import KVIntegrityError
from freetoken.kv.manager import KVManager
from freetoken.kv.tree import RadixTree
from kv_sim import AuditFailed, Sim
from test_kv_seed import make, run_seed


def inject_commit_frees_duplicates(monkeypatch: pytest.MonkeyPatch) -> None:
    """The reference engine's defect: where the tree already has an entry, the commit 'drops the
    request's duplicate' by freeing the request's page, even when it is the tree's own page."""
    original = RadixTree.insert

    def buggy_insert(self, tokens, full, swa, boundaries=()):
        existing = self._walk(tuple(tokens), len(tokens) // self.page_size)
        self.full_pool.decref([full[i] for i in range(len(existing))])
        return original(self, tokens, full, swa, boundaries)

    monkeypatch.setattr(RadixTree, "insert", buggy_insert)


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("a_first", [True, False])
def test_commit_freeing_request_duplicates_is_caught(
    monkeypatch: pytest.MonkeyPatch, page_size: int, a_first: bool
) -> None:
    inject_commit_frees_duplicates(monkeypatch)
    with pytest.raises((KVIntegrityError, AuditFailed)) as info:
        run_seed(make(page_size), head="policy", a_first=a_first)
    text = str(info.value)
    assert "full page" in text and "rc=" in text  # names the page and its count


def test_commit_freeing_duplicates_caught_by_audit_with_holders(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without the per-step audit, the idle audit still names the page and the tree holder."""
    inject_commit_frees_duplicates(monkeypatch)
    kv = KVManager(full_pages=32, swa_pages=32, page_size=1, window=4, cache_type="radix")
    sim = Sim(kv, chunk=8, audit_every_step=False)
    prompt = list(range(10, 20))
    sim.admit("A", prompt, 1)
    sim.step("A")  # commits A's prompt: the injected decref drops nothing yet (no existing path)
    sim.admit("B", prompt[:6] + [1, 2], 1)
    sim.step("B")  # B's commit walks A's path: frees B's leased/duplicate pages under B's feet
    try:
        sim.finish("B")
        sim.finish("A")
    except KVIntegrityError as err:  # a checked decref caught it first
        assert err.report.holders or err.report.refcount == 0
        return
    report = kv.audit(idle=True)
    assert not report.ok
    assert "A1" in report.checks_failed()
    v = next(v for v in report.violations if v.check == "A1")
    assert any(h.startswith("tree node") for h in v.holders)


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
