"""PagePool checks and the window arithmetic: hit-rule tables, floor, config refusal."""

from __future__ import annotations

import numpy as np
import pytest

from freetoken.errors import ConfigError
from freetoken.kv.errors import KVIntegrityError
from freetoken.kv.manager import KVManager, resolve_cache_type
from freetoken.kv.pool import PagePool
from freetoken.kv.window import (
    first_window_page, hit_length, num_pages, swa_floor,
)

# -- pool ----------------------------------------------------------------------------------


def test_alloc_all_or_nothing_and_null_never_handed_out() -> None:
    pool = PagePool("full", 4)
    assert pool.alloc(5) is None and pool.num_free == 4  # short: nothing taken
    pages = pool.alloc(4)
    assert sorted(pages) == [1, 2, 3, 4] and pool.alloc(1) is None
    assert pool.alloc(0) == []
    assert pool.decref(pages) == 4 and pool.num_free == 4


@pytest.mark.parametrize("op", ["incref", "decref"])
def test_checked_transfers(op: str) -> None:
    pool = PagePool("swa", 4)
    with pytest.raises(KVIntegrityError, match="nobody holds"):
        getattr(pool, op)([2])  # free page
    with pytest.raises(KVIntegrityError, match="NULL or out of range"):
        getattr(pool, op)([0])
    with pytest.raises(KVIntegrityError, match="out of range"):
        getattr(pool, op)([9])
    pages = pool.alloc(2)
    rc_before = pool.rc.copy()
    with pytest.raises(KVIntegrityError, match="twice") as info:
        getattr(pool, op)([pages[0], pages[1], pages[0]])
    assert info.value.report.check == "unique" and info.value.report.page == pages[0]
    assert np.array_equal(pool.rc, rc_before)  # checked before anything changed


def test_free_list_never_holds_a_page_twice() -> None:
    pool = PagePool("full", 3)
    (p,) = pool.alloc(1)
    pool.incref([p])
    pool.decref([p])
    pool.decref([p])
    with pytest.raises(KVIntegrityError):
        pool.decref([p])
    assert sorted(pool.free_pages()) == [1, 2, 3]
    pool._free.append(p)  # corrupt the free list on purpose: alloc refuses a page twice
    with pytest.raises(KVIntegrityError):
        pool.alloc(4)


def test_holders_callback_and_quarantine() -> None:
    pool = PagePool("full", 4, holders=lambda kind, page: (f"{kind}-holder-{page}",))
    (p,) = pool.alloc(1)
    assert pool.quarantine([p, 3]) == [p, 3] and pool.quarantine([3]) == []
    assert 3 not in pool.free_pages() and pool.num_quarantined == 2
    pool.decref([p])  # quarantined: never freed, never raises
    pool.decref([p])
    assert p not in pool.free_pages()
    with pytest.raises(KVIntegrityError) as info:
        pool.incref([4])
    assert info.value.report.holders == ("full-holder-4",)
    with pytest.raises(ValueError):
        PagePool("full", 0)
    with pytest.raises(ValueError):
        pool.alloc(-1)


# -- window arithmetic and the hit rule ------------------------------------------------------

L, D = True, False  # live, dead (tombstone)


@pytest.mark.parametrize(
    "path_pages, live, prompt_len, page_size, window, expected",
    [
        # page size 1, W = 4: a hit at L needs positions [L-3, L) live
        (10, [D] * 10, 11, 1, 4, 0),
        (10, [D, D, D, D, D, D, L, L, L, D], 11, 1, 4, 9),  # at the window boundary
        (10, [D, D, D, D, D, L, L, L, D, D], 11, 1, 4, 8),  # before: 9 invalid, 8 valid
        (10, [D, D, D, D, D, D, D, L, L, L], 11, 1, 4, 10),  # after: at the cap
        (10, [L] * 10, 5, 1, 4, 4),  # cap first: floor_to_page(5 - 1)
        (10, [L, L, L, D, L, L, L, D, D, D], 11, 1, 4, 7),  # tombstone mid-path
        # non-monotone: L=10 valid but above the cap (prompt 10 -> cap 9); 9 invalid; 3 valid
        (10, [L, L, L, D, D, D, D, L, L, L], 10, 1, 4, 3),
        (10, [D] * 10, 1, 1, 4, 0),  # one-token prompt: nothing to skip
        # page size 4, W = 6 (not a multiple of a page): L needs pages overlapping [L-5, L)
        (4, [D, L, L, D], 17, 4, 6, 12),  # L=12: [7,12) -> pages 1,2
        (4, [D, D, L, L], 17, 4, 6, 16),  # L=16: [11,16) -> pages 2,3
        (4, [L, D, D, L], 17, 4, 6, 4),  # L=16 needs page 2, L=8 needs page 0,1, L=4 page 0
        (4, [L, L, L, L], 16, 4, 6, 12),  # cap: floor_to_page(15) = 12
        # page size 4, W = 3 (smaller than a page): L needs the page overlapping [L-2, L)
        (3, [D, D, L], 13, 4, 3, 12),
        (3, [D, L, D], 13, 4, 3, 8),
        # page size 4, W = 13: L needs [L-12, L)
        (4, [D, L, L, L], 17, 4, 13, 16),  # [4,16) -> pages 1..3
        (4, [D, L, L, D], 17, 4, 13, 0),  # L=12 needs [0,12) -> page 0 dead
        (4, [L, L, L, D], 17, 4, 13, 12),
    ],
)
def test_hit_rule_table(path_pages, live, prompt_len, page_size, window, expected) -> None:
    assert hit_length(path_pages, live, prompt_len, page_size, window) == expected


def test_hit_rule_without_window_is_the_capped_path() -> None:
    assert hit_length(5, None, 100, 4, None) == 20
    assert hit_length(5, None, 9, 4, None) == 8


def test_window_arithmetic_and_floor() -> None:
    assert num_pages(0, 4) == 0 and num_pages(5, 4) == 2
    assert first_window_page(10, 4, 1) == 7 and first_window_page(2, 8, 4) == 0
    assert first_window_page(16, 6, 4) == 2  # [11, 16) starts in page 2
    # R (ceil((W-1)/P) + 1) + ceil(C/P) + 1
    assert swa_floor(4, 2048, 128, 1) == 4 * 128 + 2048 + 1
    assert swa_floor(2, 10, 6, 4) == 2 * (2 + 1) + 3 + 1
    with pytest.raises(ConfigError):
        swa_floor(0, 10, 6, 4)


# -- cache types and config ----------------------------------------------------------------


def test_cache_type_resolution_and_refusals() -> None:
    assert resolve_cache_type("radix", 128) == "swa_radix"
    assert resolve_cache_type("radix", None) == "radix"
    assert resolve_cache_type("naive", 128) == "naive"
    with pytest.raises(ConfigError, match="sliding-window layers"):
        KVManager(full_pages=8, swa_pages=None, page_size=1, window=None, cache_type="swa_radix")
    with pytest.raises(ConfigError, match="cache-type"):
        resolve_cache_type("lru", None)
    bad = [
        dict(full_pages=8, swa_pages=8, page_size=0, window=4),
        dict(full_pages=0, swa_pages=8, page_size=1, window=4),
        dict(full_pages=8, swa_pages=8, page_size=1, window=0),
        dict(full_pages=8, swa_pages=None, page_size=1, window=4),
        dict(full_pages=8, swa_pages=0, page_size=1, window=4),
    ]
    for kwargs in bad:
        with pytest.raises(ConfigError):
            KVManager(cache_type="radix", **kwargs)
    kv = KVManager(full_pages=8, swa_pages=8, page_size=1, window=4, cache_type="radix")
    assert kv.resolved_cache_type == "swa_radix"
    with pytest.raises(ValueError):
        kv.available("nope")
