"""Which snapshots a hybrid model's tree keeps first (kv/snapshots.py): a request's *ends* (the
snapshot at its resend cap and the deepest one on its path: where the next request of its
conversation hits, whether it repeats the reply or leaves the path after the prompt) outlast
intermediate snapshots and marked boundaries; a hit on one end of a request ends both (its
conversation went that way); the snapshot a waiting request will hit outlasts every other end."""

from __future__ import annotations

from freetoken.kv.manager import KVManager
from freetoken.kv.snapshots import snapshot_tiers

P = 4


def manager(slots: int = 8) -> KVManager:
    kv = KVManager(full_pages=64, swa_pages=None, page_size=P, window=None, cache_type="radix", state_slots=slots)
    kv.copy_state = lambda src, dst: None
    return kv


def tiers(kv: KVManager) -> dict[int, int]:
    """Snapshot position -> tier (positions are unique in these tests' trees)."""
    return {n.start + (j + 1) * P: t for (n, j), t in snapshot_tiers(kv.tree).items()}


def turn(kv: KVManager, rid: str, prompt: list[int], reply: list[int], boundaries: tuple[int, ...]) -> int:
    """A chat turn: admit, prefill in the chunks the snapshot points ask for, decode `reply`
    (a commit at each page boundary the state reaches, as the engine does), finish."""
    cached = kv.admit(rid, prompt, boundaries=boundaries)
    seq = prompt + reply
    assert kv.extend(rid, len(seq))
    start = cached
    while start < len(prompt):
        start = kv.chunk_end(rid, start, len(prompt))
        kv.commit(rid, seq[:start], boundaries)
    for n in range(len(prompt) + 1, len(seq)):
        if n % P == 0:
            kv.commit(rid, seq[:n], boundaries)
    kv.commit(rid, seq[: len(seq) - 1], boundaries)
    kv.release(rid)
    return cached


def test_a_requests_ends_outlast_its_other_snapshots() -> None:
    kv = manager()
    prompt = list(range(1, 18))  # 17 tokens: a boundary marked at 8, the resend cap at 16
    turn(kv, "a", prompt, list(range(100, 108)), (8,))  # decodes to 25: its state passes 20 and 24
    assert tiers(kv) == {8: 1, 16: 2, 24: 2}  # 20 was dropped when 24 came (a passing one)
    order = []
    while kv.tree.num_pages("state"):
        before = set(tiers(kv))
        kv.evict("state", 1)
        order.extend(before - set(tiers(kv)))
    assert order[0] == 8  # the ends last, the one past the other (the reply's) not first
    assert kv.audit(idle=True).ok


def test_the_next_turn_leaving_the_path_after_the_prompt_ends_the_replys_snapshot() -> None:
    """A template that re-renders a reply differently: the next turn leaves the path right
    after the previous prompt and hits its cap; the reply's snapshot goes first from then on."""
    kv = manager()
    prompt = list(range(1, 18))
    turn(kv, "a", prompt, list(range(100, 108)), (8,))
    nxt = prompt + [200 + i for i in range(13)]  # 30 tokens, a's reply rendered otherwise
    kv.expect("b", nxt)  # waiting: the cap it will hit outlasts everything
    assert tiers(kv) == {8: 1, 16: 3, 24: 0}
    kv.evict("state", 1)
    assert set(tiers(kv)) == {8, 16}
    assert turn(kv, "b", nxt, [300, 301, 302, 303], (8, 17, 30)) == 16
    t = tiers(kv)
    assert t[16] < 2 and t[28] == t[32] == 2, t  # no end now; b's ends: its cap and its reply's page
    assert kv.audit(idle=True).ok


def test_a_waiting_requests_hit_outlasts_the_other_ends() -> None:
    kv = manager(slots=5)
    a, c = list(range(1, 10)), list(range(50, 63))  # one snapshot each: at 8 and at 12
    turn(kv, "a", a, [], ())
    turn(kv, "c", c, [], ())  # c finished last: by age alone a's would go first
    assert tiers(kv) == {8: 2, 12: 2}
    kv.expect("a2", a + [7, 7, 7, 7])
    assert tiers(kv) == {8: 3, 12: 2}
    kv.evict("state", 1)
    assert tiers(kv) == {8: 3}
    kv.release("a2")  # a2 ends while waiting: its hit is an end like the others from now on
    assert tiers(kv) == {8: 2}
    assert kv.admit("a3", a + [5, 5]) == 8
    kv.release("a3", preempted=True)  # back in the queue: its ends are where it resumes
    assert tiers(kv) == {8: 3}
    assert kv.admit("a3", a + [5, 5]) == 8
    kv.release("a3")
    assert kv.audit(idle=True).ok


def test_the_audit_catches_an_end_on_a_slot_the_tree_does_not_hold() -> None:
    kv = manager()
    turn(kv, "a", list(range(1, 10)), [], ())
    assert kv.audit(idle=True).ok
    kv.tree.ends[7] = 99  # a record the tree's removals did not clear
    report = kv.audit(idle=True)
    assert any(v.check == "A3" and v.pool == "state" and v.page == 7 for v in report.violations)
