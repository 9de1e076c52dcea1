"""The cache report's miss reason (kv/miss.py) on a real KVManager: each reason, from the state
that causes it, and the matched length beside the hit."""

from __future__ import annotations

from freetoken.kv.manager import KVManager

P = 4


def serve(kv: KVManager, rid: str, tokens: list[int]) -> tuple[int, str | None, int]:
    """Admit, explain, write the whole prompt, commit it, release: (hit, reason, matched)."""
    cached = kv.admit(rid, tokens)
    miss = kv.explain_miss(rid, tokens)
    assert kv.extend(rid, len(tokens))
    kv.release_out_of_window(rid, len(tokens))
    kv.commit(rid, tokens)
    kv.release(rid)
    assert kv.audit(idle=True).ok
    assert miss is not None
    return cached, miss.reason, miss.matched


def full_kv(pages: int = 32) -> KVManager:
    return KVManager(full_pages=pages, swa_pages=None, page_size=P, window=None, cache_type="radix")


def test_diverged_names_the_first_token_no_path_holds() -> None:
    kv = full_kv()
    base = list(range(1, 17))  # 4 pages
    assert serve(kv, "a", base) == (0, "diverged_at_token 0", 0)
    other = base[:10] + [99] * 8  # differs inside page 2, at token 10
    assert serve(kv, "b", other) == (8, "diverged_at_token 10", 8)


def test_capped_when_the_hit_is_as_long_as_the_cap_allows() -> None:
    kv = full_kv()
    base = list(range(1, 17))
    serve(kv, "a", base)
    # The same 16 tokens again: the tree holds all 4 pages, the cap floor_to_page(15) is 12.
    assert serve(kv, "b", base) == (12, "capped", 16)


def test_evicted_when_the_next_page_was_in_the_tree() -> None:
    kv = full_kv()
    base = list(range(1, 25))  # 6 pages
    serve(kv, "a", base)
    serve(kv, "c", base[:12] + [50] * 12)  # a branch after 3 pages: a's tail is its own leaf
    assert kv.evict("full", 3) == 3  # the oldest leaf goes: pages 3-5 of `base`
    cached, reason, matched = serve(kv, "b", base + [7])
    assert (cached, reason, matched) == (12, "evicted", 12)


def test_window_evicted_when_the_full_pages_exist_but_the_window_is_tombstoned() -> None:
    kv = KVManager(full_pages=32, swa_pages=32, page_size=P, window=5, cache_type="radix")
    base = list(range(1, 25))
    serve(kv, "a", base)
    kv.evict("swa", 32)  # every live SWA entry becomes a tombstone
    cached, reason, matched = serve(kv, "b", base + [7])
    assert (cached, reason, matched) == (0, "window_evicted", 24)


def test_no_prefix_cache_explains_nothing() -> None:
    kv = KVManager(full_pages=8, swa_pages=None, page_size=P, window=None, cache_type="naive")
    kv.admit("a", [1, 2, 3, 4, 5])
    assert kv.explain_miss("a", [1, 2, 3, 4, 5]) is None
