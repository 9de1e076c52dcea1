"""The state pool of a hybrid model (kv/manager.py): slots owned like pages. A request takes its
slot with its first pages (all-or-nothing), or at admission on a hit, and gives it back at finish,
abort or preempt. The tree keeps state snapshots: a commit that finds the request's state at a
page boundary takes a slot of the tree's own (copy-on-commit), a hit needs a snapshot at exactly
its end and copies it into the request's own slot (copy-on-hit). Snapshots are evicted alone
(oldest first, marked boundaries last) or with their entries; the audit recounts the tree's
slots (A1, A2, A3, A5) and names a leaked one."""

from __future__ import annotations

from freetoken.kv.manager import KVManager
from freetoken.kv.miss import path_tokens

P = 4


def manager(slots: int = 3, pages: int = 32, interval: int = 0) -> tuple[KVManager, list[tuple[int, int]]]:
    kv = KVManager(
        full_pages=pages,
        swa_pages=None,
        page_size=P,
        window=None,
        cache_type="radix",
        state_slots=slots,
        snapshot_interval=interval,
    )
    copies: list[tuple[int, int]] = []
    kv.copy_state = lambda src, dst: copies.append((src, dst))
    return kv, copies


def run(kv: KVManager, rid: str, prompt: list[int], written: int | None = None, boundaries: tuple = ()) -> int:
    """Admit, extend, commit `written` tokens (default: all but the last), release."""
    cached = kv.admit(rid, prompt, boundaries=boundaries)
    assert kv.extend(rid, len(prompt))
    kv.commit(rid, prompt[: len(prompt) - 1 if written is None else written], boundaries)
    kv.release(rid)
    return cached


def snapshots(kv: KVManager) -> dict[int, int]:
    """Snapshot position -> slot, over the whole tree."""
    return {n.start + (j + 1) * P: s for n in kv.tree.nodes() for j, s in enumerate(n.state) if s}


def test_slot_taken_with_the_pages_and_released_at_finish_abort_and_preempt() -> None:
    kv, _ = manager(slots=4)
    for rid in ("finish", "abort", "preempt"):
        assert kv.admit(rid, list(range(10))) == 0
        assert kv.state_slot(rid) == 0  # no slot before the pages
        assert kv.extend(rid, 10)
    slots = [kv.state_slot(r) for r in ("finish", "abort", "preempt")]
    assert sorted(slots) == [1, 2, 3] and kv.state_pool.num_free == 1
    assert kv.audit(idle=False).ok
    kv.commit("finish", list(range(9)))  # 9 written: the state is not at a page boundary
    kv.release("finish")
    kv.release("abort")
    kv.commit("preempt", list(range(8)))  # 8 written: a snapshot at 8
    kv.release("preempt", preempted=True)
    kv.release("abort")  # a second release is a no-op
    assert list(snapshots(kv)) == [8] and kv.state_pool.num_free == 3
    report = kv.audit(idle=True)
    assert report.ok, report
    assert kv.status()["pools"]["state"] == {
        "capacity": 4, "free": 3, "cached": 1, "in_use": 0, "quarantined": 0, "target": 4, "pending_release": 0,
    }  # fmt: skip


def test_no_free_slot_defers_the_request_and_takes_nothing() -> None:
    kv, _ = manager(slots=1)
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
    kv, _ = manager()
    kv.admit("a", [1, 2, 3])
    assert kv.extend("a", 3)
    slot = kv.state_slot("a")
    kv._requests["a"].state = 0  # the request forgets its slot: nobody will ever release it
    kv.release("a")
    report = kv.audit(idle=True)
    assert {"A1", "A5"} <= report.checks_failed()
    leaked = [v for v in report.violations if v.check == "A1"]
    assert leaked[0].pool == "state" and leaked[0].page == slot


def test_held_pages_without_a_snapshot_at_their_end_hit_nothing() -> None:
    kv, copies = manager()
    prompt = list(range(13))
    run(kv, "a", prompt, written=11)  # 8 tokens committed, the state at 11: no snapshot
    assert snapshots(kv) == {} and copies == []
    assert kv.admit("b", prompt) == 0
    miss = kv.explain_miss("b", prompt)
    assert (miss.matched, miss.reason) == (8, "state_missing")
    assert kv.full_pool.rc[1:].sum() == 2 and kv.state_slot("b") == 0  # b took no reference
    kv.release("b")
    assert kv.audit(idle=True).ok


def test_copy_on_commit_and_copy_on_hit() -> None:
    kv, copies = manager()
    prompt = list(range(13))
    kv.admit("a", prompt)
    assert kv.extend("a", 13)
    mine = kv.state_slot("a")
    kv.commit("a", prompt[:12])  # the state is at 12
    (snap,) = snapshots(kv).values()
    assert snap != mine and copies == [(mine, snap)]
    kv.release("a")
    assert kv.admit("b", prompt) == 12  # the cap: the snapshot at 12
    own = kv.state_slot("b")
    assert own not in (0, snap) and copies[-1] == (snap, own)
    assert kv.state_pool.rc[snap] == kv.state_pool.rc[own] == 1  # each holds its own slot
    assert kv.audit(idle=False).ok
    assert kv.extend("b", 13)
    assert kv.state_slot("b") == own  # extend takes no second slot
    kv.commit("b", prompt[:12])  # the tree keeps its own snapshot
    assert snapshots(kv) == {12: snap} and len(copies) == 2
    kv.release("b")
    assert kv.audit(idle=True).ok


def test_the_hit_is_the_longest_prefix_with_a_snapshot_at_its_end() -> None:
    kv, _ = manager(slots=6)
    base = list(range(100, 120))
    run(kv, "a", base[:5], written=4)  # snapshot at 4
    run(kv, "b", base[:13], written=12)  # snapshot at 12, pages 0..2 committed
    run(kv, "c", base[:19], written=18)  # page 3 committed, no snapshot at 16
    assert sorted(snapshots(kv)) == [4, 12]
    assert kv.admit("d", base[:18]) == 12  # pages up to 16 exist, the state only at 12
    miss = kv.explain_miss("d", base[:18])
    assert (miss.matched, miss.reason) == (16, "state_missing")
    kv.release("d")
    assert kv.admit("e", base[:11]) == 4  # cap 8: the snapshot at 4
    kv.release("e")
    assert kv.audit(idle=True).ok


def test_snapshot_points_end_prompt_chunks() -> None:
    """Marked boundaries (floored to a page), the resend cap and every `interval` tokens."""
    kv, _ = manager(interval=8)
    prompt = list(range(23))
    kv.admit("a", prompt, boundaries=[6, 10])
    assert kv._requests["a"].stops == (4, 8, 16, 20)
    ends, start = [], 0
    while start < 23:
        start = kv.chunk_end("a", start, min(start + 16, 23))
        ends.append(start)
    assert ends == [4, 8, 16, 20, 23]
    kv.release("a")


def test_a_branch_point_becomes_a_snapshot_point() -> None:
    """b shares 8 tokens of a's prompt, then diverges: b's chunk ends there, so a third prompt
    forking at the same place hits there."""
    kv, _ = manager(slots=6)
    a = list(range(16)) + [99]
    run(kv, "a", a, written=16)
    b = list(range(8)) + [50 + i for i in range(9)]
    assert kv.admit("b", b) == 0
    assert kv.chunk_end("b", 0, 17) == 8
    assert kv.extend("b", 8)
    kv.commit("b", b[:8])
    kv.release("b")
    c = list(range(8)) + [70 + i for i in range(9)]
    assert kv.admit("c", c) == 8
    kv.release("c")
    assert kv.audit(idle=True).ok


def test_snapshots_are_evicted_by_tier_then_oldest_first() -> None:
    """A snapshot with another one further down its path goes first (a continuation hits the
    later one), then such a one at a marked boundary, then the last snapshot of a path (oldest
    first), a branch point last. The entries and their pages stay."""
    kv, _ = manager(slots=6)
    run(kv, "lone", [5] * 9, written=8)  # the oldest, but the last snapshot of its path
    conv = list(range(30))
    kv.admit("c", conv[:17], boundaries=(8,))
    assert kv.extend("c", 17)
    for n in (8, 12, 16):  # 8 marked, 12 a passing one kept by a fork below, 16 the last
        kv.commit("c", conv[:n], (8,))
        if n == 12:
            kv.admit("f", conv[:12] + [99] * 5)  # forks at 12: 12 is kept as a branch point
            assert kv.extend("f", 17)
            kv.commit("f", conv[:12] + [99] * 4)
            kv.release("f")
    kv.release("c")
    kv.admit("d", conv[:13])  # hits 12, with a copy of its snapshot: the branch point renewed
    kv.release("d")

    def labels() -> dict[int, tuple[int, int]]:
        """slot -> (its path's last token, its position)."""
        out = {}
        for slot, node in kv.tree.owned("state").items():
            end = node.start + (node.state.index(slot) + 1) * P
            out[slot] = (path_tokens(node)[end - 1], end)
        return out

    assert sorted(labels().values()) == [(5, 8), (7, 8), (11, 12), (15, 16), (99, 16)]
    order = []
    while kv.tree.num_pages("state"):
        before = labels()
        assert kv.evict("state", 1) == 1
        (gone,) = set(before) - set(labels())
        order.append(before[gone])
    # c's marked 8 (mid-path), then the last ones of their paths oldest first (lone's 8, f's 16,
    # c's 16), the branch point at 12 last
    assert order == [(7, 8), (5, 8), (99, 16), (15, 16), (11, 12)]
    assert kv.audit(idle=True).ok
    assert kv.full_pool.num_free == 32 - 2 - 4 - 1  # every entry kept its pages


def test_removing_an_entry_releases_its_snapshot() -> None:
    kv, _ = manager()
    run(kv, "a", list(range(9)), written=8)
    assert kv.state_pool.num_free == 2
    assert kv.available("state") == 3
    kv.evict("full", 32)
    assert kv.state_pool.num_free == 3 and snapshots(kv) == {}
    assert kv.audit(idle=True).ok


def test_quarantined_snapshot_leaves_the_tree() -> None:
    kv, _ = manager()
    run(kv, "a", list(range(9)), written=8)
    (slot,) = snapshots(kv).values()
    assert kv.quarantine("state", [slot]) == set()
    assert snapshots(kv) == {} and kv.tree.num_pages("full") == 2
    assert kv.audit(idle=True).ok
    assert kv.admit("b", list(range(9))) == 0
    kv.release("b")


def test_audit_catches_a_leaked_or_shared_snapshot() -> None:
    kv, _ = manager()
    run(kv, "a", list(range(9)), written=8)
    (slot,) = snapshots(kv).values()
    node = kv.tree.owned("state")[slot]
    node.state[node.state.index(slot)] = 0  # the tree forgets its snapshot: never released
    report = kv.audit(idle=True)
    assert {"A1", "A5"} <= report.checks_failed()
    assert any(v.pool == "state" and v.page == slot for v in report.violations)

    kv, _ = manager()
    run(kv, "a", list(range(9)), written=8)
    (slot,) = snapshots(kv).values()
    kv.admit("b", [7, 7, 7])
    kv.state_pool.incref([slot])
    kv._requests["b"].state = slot  # a request would write into the tree's snapshot
    report = kv.audit(idle=False)
    shared = [v for v in report.violations if v.check == "A3"]
    assert shared and shared[0].page == slot and any("snapshot" in h for h in shared[0].holders)


def test_only_the_latest_snapshot_at_no_planned_point_is_kept() -> None:
    """Decode steps reaching page boundaries (commits of 12, 16, 20 tokens, no planned point
    there) keep only the latest snapshot; planned points (the boundary at 8) stay; one that
    became a branch point meanwhile stays too."""
    kv, _ = manager(slots=8)
    prompt = list(range(9))
    kv.admit("a", prompt, boundaries=(8,))
    assert kv._requests["a"].stops == (8,)
    assert kv.extend("a", 24)
    seq = prompt + list(range(50, 65))
    for n in (8, 12, 16):
        kv.commit("a", seq[:n])
    assert sorted(snapshots(kv)) == [8, 16]
    fork = seq[:16] + [99] * 5
    kv.admit("b", fork)  # hits at 16
    assert kv.extend("b", 21)
    kv.commit("b", fork[:20])  # a branch at 16 now
    kv.commit("a", seq[:20])
    ends = sorted(n.start + (j + 1) * P for n in kv.tree.nodes() for j, s in enumerate(n.state) if s)
    assert ends == [8, 16, 20, 20]  # a's 20 and b's 20 (on another branch)
    kv.release("a")
    kv.release("b")
    assert kv.audit(idle=True).ok
