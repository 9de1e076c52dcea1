"""Retention pins (kv/pins.py) on a real KVManager with a fake clock: eviction skips a pinned
path until it expires, a hit renews it, the cap refuses (and counts) a pin past it, and a pin
splits its node at the breakpoint so nothing past it is kept. Audited after every change."""

from __future__ import annotations

from freetoken.kv.manager import KVManager
from freetoken.kv.pins import live_pins

P = 4


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def serve(kv: KVManager, rid: str, tokens: list[int], marks: tuple[int, ...] = ()) -> int:
    """Admit, write, commit (marking `marks`: a breakpoint is a boundary, so its window stays
    live, as the server marks it), release; returns the hit."""
    cached = kv.admit(rid, tokens)
    assert kv.extend(rid, len(tokens))
    kv.commit(rid, tokens, boundaries=marks)
    kv.release_out_of_window(rid, len(tokens))
    kv.release(rid)
    assert kv.audit(idle=True).ok
    return cached


def make(clock: Clock, window: int | None = None, max_pinned: int | None = None) -> KVManager:
    return KVManager(full_pages=32, swa_pages=32 if window else None, page_size=P, window=window,
                     cache_type="radix", max_pinned_pages=max_pinned, clock=clock)


def test_a_pinned_path_survives_eviction_until_it_expires_and_a_hit_renews_it() -> None:
    clock = Clock()
    kv = make(clock, window=5)
    system = list(range(1, 17))  # 4 pages
    serve(kv, "a", system + [50, 51, 52, 53, 54], marks=(16,))
    assert kv.pin(system, 16, 300.0) == 16
    assert kv.status()["pins"]["pinned_pages"] == 4
    assert kv.available("full") == kv.full_pool.num_free + 1  # only the unpinned tail page
    kv.evict("full", 32)
    kv.evict("swa", 32)
    assert kv.audit(idle=True).ok
    clock.now += 250.0  # within the TTL (pinned until 1300)
    assert serve(kv, "b", system + [60, 61]) == 16  # the system prompt hits, its window live: until 1550
    clock.now += 200.0  # 450 s after the pin, 200 after the renewing hit
    kv.evict("full", 32)
    kv.evict("swa", 32)
    assert serve(kv, "c", system + [70, 71]) == 16  # renews until 1750
    clock.now += 301.0  # expired
    assert not live_pins(kv.tree)
    kv.evict("swa", 32)
    kv.evict("full", 32)
    assert kv.tree.num_pages("full") == 0 and kv.audit(idle=True).ok


def test_the_pin_stops_at_its_breakpoint() -> None:
    clock = Clock()
    kv = make(clock)
    seq = list(range(1, 25))  # 6 pages in one node
    serve(kv, "a", seq)
    assert kv.pin(seq, 10, 60.0) == 8  # floored to 2 pages: the node is split there
    assert [n.npages for n in live_pins(kv.tree)] == [2]
    assert kv.evict("full", 32) == 4  # the 4 pages past the breakpoint go
    assert kv.tree.num_pages("full") == 2 and kv.audit(idle=True).ok


def test_a_pin_past_the_cap_is_refused_and_counted() -> None:
    clock = Clock()
    kv = make(clock, max_pinned=5)
    one, two = list(range(1, 17)), list(range(100, 116))
    serve(kv, "a", one)
    serve(kv, "b", two)
    assert kv.pin(one, 16, 60.0) == 16
    assert kv.pin(two, 16, 60.0) == 0  # 4 + 4 > 5
    assert kv.pin(one, 16, 60.0) == 16  # renewing a pinned path takes no new page
    assert kv.pin([999] * 16, 16, 60.0) == 0 and kv.status()["pins"]["refused"] == 1  # not committed: not counted
    assert kv.status()["pins"] == {"pinned_pages": 4, "max_pinned_pages": 5, "pinned_swa_pages": 0, "made": 2, "refused": 1, "released": 0}
    kv.evict("full", 32)
    assert kv.tree.num_pages("full") == 4
