"""The audit catches each kind of corruption it claims to (each check is shown failing)."""

from __future__ import annotations

import pytest

from freetoken.kv.errors import KVIntegrityError
from freetoken.kv.manager import KVManager
from kv_sim import Sim


@pytest.fixture
def sim() -> Sim:
    kv = KVManager(full_pages=32, swa_pages=32, page_size=2, window=5, cache_type="radix")
    s = Sim(kv, chunk=8, audit_every_step=False)
    s.admit("a", list(range(20)), 3)
    s.step("a")
    s.step("a")
    s.check()
    return s


def failed(sim: Sim, idle: bool = False) -> set[str]:
    report = sim.kv.audit(idle=idle)
    assert not report.ok and str(report) != "audit clean"
    return report.checks_failed()


def test_free_list_corruptions(sim: Sim) -> None:
    pool = sim.kv.full_pool
    held = int(sim.kv.page_tables("a")[0][0])
    free = pool.free_pages()[0]
    pool._free.extend([free, 0, held])
    assert failed(sim) == {"A2"}
    pool._free = [p for p in pool._free if p != free]  # a free page leaks off the list
    pool._free = pool._free[:-2]
    assert "A2" in failed(sim)


def test_quarantined_page_on_free_list(sim: Sim) -> None:
    pool = sim.kv.swa_pool
    page = pool.free_pages()[0]
    pool.quarantine([page])
    pool._free.append(page)
    assert failed(sim) == {"A2"}


def test_null_reference_and_tree_structure(sim: Sim) -> None:
    node = next(iter(sim.kv.tree.nodes()))
    node.full[0] = 0
    assert {"A1", "A3"} <= failed(sim)


def test_tree_page_in_two_entries_and_bad_node(sim: Sim) -> None:
    kv = sim.kv
    sim.admit("b", [50, 51, 52, 53, 54], 1)
    sim.run_to_end("b")
    first, second = list(kv.tree.nodes())[:2]
    second.full[0] = first.full[0]
    assert {"A1", "A3"} <= failed(sim)
    second.full[0] = 1_000_000 % 31 + 1
    second.key = second.key[:-1]
    assert "A3" in failed(sim)


@pytest.mark.parametrize("mutation", ["empty", "detached", "live_count"])
def test_node_shape_checks(sim: Sim, mutation: str) -> None:
    node = next(iter(sim.kv.tree.nodes()))
    if mutation == "empty":
        node.key, node.full, node.swa, node.pri = (), [], [], []
    elif mutation == "detached":
        node.start += 2
    else:
        node.live += 1
    assert "A3" in failed(sim)


def test_request_window_checks(sim: Sim) -> None:
    kv = sim.kv
    req = kv._requests["a"]
    live_idx = next(i for i, p in enumerate(req.swa) if p)
    page = req.swa[live_idx]
    req.swa[live_idx] = 0  # an in-window entry lost (reference count now off too)
    assert {"A1", "A4"} <= failed(sim)
    req.swa[live_idx] = page
    req.next_pos += 10  # entries now out of the window but still live
    assert failed(sim) == {"A4"}
    req.next_pos -= 10
    req.full.append(0)
    req.swa.append(0)
    assert failed(sim) == {"A4"}
    req.swa.pop()
    assert failed(sim) == {"A4"}


def test_idle_balance_and_null_refcount(sim: Sim) -> None:
    assert sim.kv.extend("a", 30)  # pages only the request holds: not idle
    assert failed(sim, idle=True) == {"A5"}
    sim.kv.full_pool.rc[0] = 1
    assert "A1" in failed(sim)


def test_audit_raises_with_all_reports(sim: Sim) -> None:
    sim.kv.swa_pool.rc[1:] += 1
    report = sim.kv.audit(idle=False)
    with pytest.raises(KVIntegrityError) as info:
        report.raise_if_failed()
    assert sum(r.check == "A1" for r in info.value.reports) == 20  # capped per check
    sim.kv.record_error(info.value)
    assert sim.kv.status()["integrity"]["violations"] == 2
