"""The state pool of a hybrid model (kv/manager.py): one slot per running request, owned like a
page. A request takes its slot with its first pages (all-or-nothing), gives it back at finish,
abort or preempt, and the audit recounts the slots (A1, A2, A5) and names a leaked one. The
tree keeps no state snapshot yet: a prompt whose pages the tree holds hits 0 tokens, and the
miss reason says the state was missing."""

from __future__ import annotations

from freetoken.kv.manager import KVManager

P = 4


def manager(slots: int = 3, pages: int = 32) -> KVManager:
    return KVManager(full_pages=pages, swa_pages=None, page_size=P, window=None, cache_type="radix", state_slots=slots)


def test_slot_taken_with_the_pages_and_released_at_finish_abort_and_preempt() -> None:
    kv = manager()
    for rid in ("finish", "abort", "preempt"):
        assert kv.admit(rid, list(range(10))) == 0
        assert kv.state_slot(rid) == 0  # no slot before the pages
        assert kv.extend(rid, 10)
    slots = [kv.state_slot(r) for r in ("finish", "abort", "preempt")]
    assert sorted(slots) == [1, 2, 3] and kv.state_pool.num_free == 0
    assert kv.audit(idle=False).ok
    kv.commit("finish", list(range(9)))
    kv.release("finish")
    kv.release("abort")
    kv.commit("preempt", list(range(8)))
    kv.release("preempt", preempted=True)
    kv.release("abort")  # a second release is a no-op
    assert kv.state_pool.num_free == 3
    report = kv.audit(idle=True)
    assert report.ok, report
    assert kv.status()["pools"]["state"] == {
        "capacity": 3, "free": 3, "cached": 0, "in_use": 0, "quarantined": 0, "target": 3, "pending_release": 0,
    }  # fmt: skip


def test_no_free_slot_defers_the_request_and_takes_nothing() -> None:
    kv = manager(slots=1)
    kv.admit("a", [1, 2, 3])
    assert kv.extend("a", 3)
    kv.admit("b", [4, 5, 6])
    free_pages = kv.full_pool.num_free
    assert not kv.extend("b", 3)
    assert kv.full_pool.num_free == free_pages and kv.state_slot("b") == 0
    kv.release("b")
    kv.release("a")
    assert kv.audit(idle=True).ok


def test_audit_names_a_leaked_slot() -> None:
    kv = manager()
    kv.admit("a", [1, 2, 3])
    assert kv.extend("a", 3)
    slot = kv.state_slot("a")
    kv._requests["a"].state = 0  # the request forgets its slot: nobody will ever release it
    kv.release("a")
    report = kv.audit(idle=True)
    assert {"A1", "A5"} <= report.checks_failed()
    leaked = [v for v in report.violations if v.check == "A1"]
    assert leaked[0].pool == "state" and leaked[0].page == slot


def test_held_pages_hit_nothing_without_a_state_snapshot() -> None:
    kv = manager()
    prompt = list(range(13))
    kv.admit("a", prompt)
    assert kv.extend("a", 13)
    kv.commit("a", prompt[:12])
    kv.release("a")
    assert kv.admit("b", prompt) == 0
    miss = kv.explain_miss("b", prompt)
    assert (miss.matched, miss.reason) == (12, "state_missing")
    assert kv.full_pool.rc[1:].sum() == 3  # the tree's 3 pages only: b took no reference
    kv.release("b")
    assert kv.audit(idle=True).ok
