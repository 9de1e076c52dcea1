"""Tree policy through the manager: fan-out reuse, kept windows, eviction order, capacity,
preemption stamps and quarantine."""

from __future__ import annotations

import pytest

from freetoken.kv.manager import KVManager
from kv_sim import Sim

S = list(range(200, 240))  # a 40-token shared prefix (system prompt)


def make(page_size: int, window: int | None, full: int = 128, swa: int = 128) -> Sim:
    kv = KVManager(full_pages=full, swa_pages=swa if window else None, page_size=page_size,
                   window=window, cache_type="radix")
    return Sim(kv, chunk=16)


def unprotected_live(kv: KVManager) -> int:
    rc = kv.swa_pool.rc
    return sum(1 for n in kv.tree.nodes() for j, s in enumerate(n.swa)
               if s and rc[s] == 1 and not n.pri[j])


@pytest.mark.parametrize("page_size, window", [(1, 8), (4, 6), (4, 13)])
def test_fan_out_with_marked_boundary(page_size: int, window: int) -> None:
    sim = make(page_size, window)
    sim.admit("r1", S + [1, 2, 3, 4, 5, 6, 7, 8, 9], 3, boundaries=[len(S)])
    sim.run_to_end("r1")
    r2 = sim.admit("r2", S + [11, 12, 13, 14, 15, 16], 3, boundaries=[len(S)])
    assert r2.cached == len(S)  # the whole shared prefix
    sim.run_to_end("r2")
    sim.kv.evict("swa", unprotected_live(sim.kv))  # pressure: every unprotected window goes
    assert sim.kv.swa_pool.num_free < sim.kv.swa_pool.capacity  # the fork's window stayed
    assert sim.admit("r3", S + [21, 22, 23, 24, 25], 2).cached == len(S)
    sim.run_to_end("r3")
    sim.check()


@pytest.mark.parametrize("page_size, window", [(1, 8), (4, 6)])
def test_fork_seen_once_hits_at_the_fork(page_size: int, window: int) -> None:
    sim = make(page_size, window)
    sim.admit("r1", S + [1, 2, 3, 4, 5, 6, 7, 8], 3)  # no boundary: S's window is tombstoned
    sim.run_to_end("r1")
    assert sim.admit("r2", S + [11, 12, 13, 14, 15], 3).cached < len(S)  # at best a chunk end
    sim.run_to_end("r2")  # r2's commit makes the fork and keeps the window before it live
    sim.kv.evict("swa", unprotected_live(sim.kv))
    assert sim.admit("r3", S + [21, 22, 23, 24], 2).cached == len(S)
    sim.run_to_end("r3")
    sim.check()


def test_second_conversation_over_shared_system_prompt() -> None:
    sim = make(1, 8)
    sim.admit("c1", S + [1, 2, 3], 4, boundaries=[len(S), len(S) + 3])
    c1 = sim.run_to_end("c1")
    turn2 = c1.tokens[:-1] + [50, 51]  # the conversation continues: reuse up to the end
    assert sim.admit("c1b", turn2, 1).cached == len(c1.tokens) - 1
    sim.run_to_end("c1b")
    assert sim.admit("c2", S + [9, 9, 9], 1).cached == len(S)


def test_non_monotone_hit_on_the_tree() -> None:
    sim = make(1, 4)
    seq = list(range(300, 312))
    sim.admit("a", seq, 1, boundaries=[3])
    sim.run_to_end("a")  # committed 12 tokens; live [0,3) (boundary), [9,12) (end), [8,11) (a resend's)
    # The same 12 tokens again hit at their cap, 11 (the window before it is kept for exactly that).
    # A prompt that leaves the path at 10: L=10..4 have a dead page in their window; 3 has not.
    assert sim.admit("b", seq[:10] + [998, 999], 1).cached == 3
    sim.run_to_end("b")
    assert sim.admit("c", seq, 1).cached == 11


def test_swa_eviction_tombstones_oldest_unprotected_first() -> None:
    sim = make(1, 4)
    sim.admit("old", [1] * 3 + list(range(10, 20)), 1, boundaries=[3])
    sim.run_to_end("old")
    sim.admit("new", list(range(40, 52)), 1)
    sim.run_to_end("new")
    kv = sim.kv
    old_end = kv.tree._walk(tuple([1] * 3 + list(range(10, 20))), 13)
    # live at its end: the window before 13 (pages 10-12) and before 12 (9-11), where a resend hits
    assert all(n.swa[j] for n, j in old_end[-4:])
    kv.evict("swa", 4)
    assert not any(n.swa[j] for n, j in old_end[-4:])  # the oldest unprotected window went first
    assert all(n.swa[j] for n, j in old_end[:3])  # the marked boundary's window is still live
    kv.evict("swa", 1000)
    assert kv.swa_pool.num_free == kv.swa_pool.capacity
    assert kv.admit("again", [1] * 3 + [10, 11], use_cache=True) == 0  # only tombstones left
    kv.release("again")
    sim.check()


def test_capacity_does_not_count_tree_only_node_above_a_held_subtree() -> None:
    sim = make(1, None, full=64)
    kv = sim.kv
    head = list(range(500, 510))
    sim.admit("R", head + list(range(600, 610)), 3)  # admitted before X commits: own copy
    sim.admit("X", head, 1)
    assert sim.step("X") and sim.step("R")  # X commits head, R commits head (dup) + its tail
    assert sim.step("R")
    sim.finish("X")  # head node is tree-only, but R holds its child (R's tail)
    free = kv.full_pool.num_free
    assert kv.available("full") == free  # nothing promised
    assert kv.evict("full", 1000) == 0
    sim.finish("R")
    assert kv.available("full") == kv.full_pool.capacity  # now the whole path is tree-only
    kv.evict("full", 1000)
    assert kv.full_pool.num_free == kv.full_pool.capacity


def test_capacity_excludes_the_new_requests_lease() -> None:
    sim = make(4, 6, full=32, swa=32)
    kv = sim.kv
    sim.admit("a", S[:16] + [1], 1)
    sim.run_to_end("a")
    before = kv.available("full"), kv.available("swa")
    cached = kv.admit("b", S[:16] + [2, 3])
    assert cached == 16
    after = kv.available("full"), kv.available("swa")
    assert after[0] == before[0] - 4  # the 4 pinned full pages are no longer promised
    assert after[1] < before[1]
    for kind in ("full", "swa"):  # and what is promised is exactly what eviction frees
        promised = kv.available(kind)
        kv.evict(kind, 10_000)
        pool = kv.full_pool if kind == "full" else kv.swa_pool
        assert pool.num_free == promised
    kv.release("b")


def test_extend_is_all_or_nothing_and_evicts() -> None:
    sim = make(1, 4, full=20, swa=20)
    kv = sim.kv
    sim.admit("a", list(range(12)), 1)
    sim.run_to_end("a")  # tree holds 12 full pages
    kv.admit("b", list(range(100, 130)))
    assert not kv.extend("b", 30)  # 30 > 20 pages: nothing allocated
    assert kv.page_tables("b")[0].size == 0
    assert kv.extend("b", 20)  # evicts a's pages to fit
    full, swa = kv.page_tables("b")
    assert full.dtype.name == "int32" and swa is not None and swa.size == full.size == 20
    assert kv.extend("b", 20)  # no-op
    kv.release("b")
    sim.check()


def test_preempted_request_is_stamped_recent_and_resumes_with_a_hit() -> None:
    sim = make(1, None, full=40)
    kv = sim.kv
    sim.admit("p", list(range(700, 716)), 10)
    sim.step("p")
    sim.step("p")
    sim.admit("old", list(range(800, 816)), 1)
    sim.run_to_end("old")  # finished after p's last commit: more recent than p's path
    p = sim.finish("p", preempted=True)  # p's path is stamped now: newer than old's
    kv.evict("full", 16)
    resumed = kv.admit("p2", p.tokens)
    assert resumed == len(p.tokens) - 1
    assert kv.admit("old2", list(range(800, 816))) == 0  # the older path went first


def test_quarantine_drops_tree_entries_and_names_holders() -> None:
    sim = make(1, 8)
    kv = sim.kv
    sim.admit("a", list(range(30)), 2)
    sim.step("a")
    sim.step("a")
    full, swa = kv.page_tables("a")
    mid = int(full[10])
    assert kv.quarantine("full", [mid]) == {"a"}
    assert kv.tree.num_pages("full") == 10  # the path stops before the quarantined page
    live_swa = int(swa[-1])
    assert kv.quarantine("swa", [live_swa, 0, 10_000]) == {"a"}
    assert kv.quarantine("full", []) == set()
    sim.finish("a")  # commits stop before the quarantined page; release is safe
    sim.check()
    st = kv.status()
    assert st["pools"]["full"]["quarantined"] == 1 and st["pools"]["swa"]["quarantined"] == 1
    assert st["integrity"]["quarantined_pages"] == 2
    assert kv.admit("b", list(range(30)) + [1]) <= 10


def test_naive_and_misuse() -> None:
    kv = KVManager(full_pages=8, swa_pages=8, page_size=2, window=3, cache_type="naive")
    assert kv.admit("a", [1, 2, 3, 4, 5]) == 0
    with pytest.raises(ValueError):
        kv.admit("a", [1])
    with pytest.raises(KeyError):
        kv.extend("zz", 3)
    assert kv.extend("a", 5) and kv.pages_needed("a", 7) == 1
    with pytest.raises(ValueError):
        kv.commit("a", list(range(8)))
    kv.commit("a", [1, 2, 3, 4, 5])  # no tree: nothing kept
    assert kv.release_out_of_window("a", 5) == 1  # page 0 ([0,2)) is out of a 3-token window
    assert kv.evict("full", 4) == 0 and kv.available("full") == 5
    assert kv.request_ids == ["a"]
    kv.release("a")
    assert kv.audit(idle=True).ok


@pytest.mark.parametrize("page_size, window, pages", [(4, 13, 12), (16, 512, 54), (1, 8, 40)])
def test_a_page_aligned_prompt_sent_again_hits_one_page_short_of_its_end(page_size: int, window: int, pages: int) -> None:
    """Prefilled in one chunk, only the prompt's end commits a window; a resend must compute its
    last token, so it hits one page earlier, whose window reaches one page further back. The
    tree keeps that page too: before, such a prompt (1 in 16 at page size 16, e.g. Gemma 3's
    864-token one) never hit again."""
    kv = KVManager(full_pages=256, swa_pages=256, page_size=page_size, window=window, cache_type="radix")
    sim = Sim(kv, chunk=4096)
    prompt = list(range(300, 300 + pages * page_size))
    sim.admit("a", prompt, 3)
    sim.run_to_end("a")
    assert sim.admit("b", prompt, 3).cached == len(prompt) - page_size
    sim.run_to_end("b")
    sim.check()
