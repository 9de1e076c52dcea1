"""The content oracle catches what the audit cannot: bugs that point a holder at the wrong
page while every reference count still adds up. Each bug is injected (monkeypatched here, never
in freetoken/) and the same traffic is run twice: the audit alone passes it, the shadow model
fails it, naming the holder and the positions."""

from __future__ import annotations

from collections.abc import Callable

import pytest

import freetoken.kv.manager as manager_module
from engine_sim import Setup, drain, make_engine, step, submit
from freetoken.kv.manager import KVManager
from freetoken.kv.tree import RadixTree, TreeMatch
from shadow import CheckedKV, ShadowViolation

S = [3 + (i * 11) % 50 for i in range(30)]


class AuditOnly(CheckedKV):
    """The same run with the shadow model off: only A1-A5 after every call."""

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)
        self.shadow.enabled = False


class ShadowOnly(CheckedKV):
    """The shadow model alone: no audit after the calls (and none from the engine)."""

    audit_each_call = False


def traffic(kv_class: type[CheckedKV], page_size: int = 2) -> None:
    """Two turns over one prefix (hits), a fan-out beside a running request, eviction."""
    engine = make_engine(Setup(page_size, 6, full_pages=96 // page_size, chunk=8), kv_class,
                         debug_kv=kv_class is not ShadowOnly)
    submit(engine, "r1", S[:20], 4)
    drain(engine)
    submit(engine, "r2", S[:20] + [60, 61, 62], 5)
    submit(engine, "r3", S + [63], 3)
    step(engine)
    submit(engine, "r4", S[:12] + [64, 65], 4)
    drain(engine)
    engine.kv.evict("swa", 4)
    submit(engine, "r5", S[:26] + [66], 3)
    drain(engine)
    # A prompt leaving the path where the window before its cap is gone: it recomputes pages the
    # tree holds live, and its commit heals the entry past them.
    submit(engine, "r6", S[:16] + [67, 68, 69], 3)
    drain(engine)


def rotate(pages: list[int]) -> list[int]:
    return pages[1:] + pages[:1] if len(pages) >= 2 else pages


def hit_one_page_off(monkeypatch: pytest.MonkeyPatch) -> None:
    original = RadixTree.match

    def match(self: RadixTree, tokens: tuple[int, ...]) -> TreeMatch:
        hit = original(self, tokens)
        return TreeMatch(hit.length, rotate(hit.full), hit.swa)

    monkeypatch.setattr(RadixTree, "match", match)


def heal_with_wrong_page(monkeypatch: pytest.MonkeyPatch) -> None:
    """An entry the commit makes live takes the request's page of the position before it,
    where the tree already has that earlier entry live (so the page is in no tree entry)."""
    original = RadixTree.insert

    def insert(self: RadixTree, tokens, full, swa, boundaries=(), resend_at=None):  # type: ignore[no-untyped-def]
        if swa is not None:
            entries = self._walk(tuple(tokens), len(tokens) // self.page_size)
            swa = list(swa)
            for i in range(1, len(swa)):
                tree_page = entries[i - 1][0].swa[entries[i - 1][1]] if i - 1 < len(entries) else 0
                before_live = tree_page != 0 and tree_page != swa[i - 1]  # the request's own copy
                absent = i >= len(entries) or not entries[i][0].swa[entries[i][1]]
                if before_live and absent and swa[i] and swa[i - 1]:
                    swa[i] = swa[i - 1]
                    break
        return original(self, tokens, full, swa, boundaries, resend_at)

    monkeypatch.setattr(RadixTree, "insert", insert)


def commit_wrong_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    original = RadixTree._add_leaf

    def add_leaf(self: RadixTree, parent, tokens, pos, full, stamp):  # type: ignore[no-untyped-def]
        p = self.page_size
        new = list(full)
        lo, hi = pos // p, len(tokens) // p
        new[lo:hi] = rotate(new[lo:hi])  # the new node's pages in the wrong order
        return original(self, parent, tokens, pos, new, stamp)

    monkeypatch.setattr(RadixTree, "_add_leaf", add_leaf)


def match_swa_one_off(monkeypatch: pytest.MonkeyPatch) -> None:
    original = RadixTree.match

    def match(self: RadixTree, tokens: tuple[int, ...]) -> TreeMatch:
        hit = original(self, tokens)
        if hit.swa is None:
            return hit
        live = [i for i, s in enumerate(hit.swa) if s]
        swa = list(hit.swa)
        if len(live) >= 2:
            a, b = live[0], live[1]
            swa[a], swa[b] = swa[b], swa[a]
        return TreeMatch(hit.length, hit.full, swa)

    monkeypatch.setattr(RadixTree, "match", match)


CONTENT_BUGS: dict[str, Callable[[pytest.MonkeyPatch], None]] = {
    "hit one page off": hit_one_page_off,
    "heal with the wrong page": heal_with_wrong_page,
    "commit with the pages out of order": commit_wrong_pages,
    "hit hands out SWA pages swapped": match_swa_one_off,
}


def test_traffic_is_clean() -> None:
    traffic(CheckedKV, 1)
    traffic(CheckedKV, 2)


@pytest.mark.parametrize("bug", CONTENT_BUGS, ids=str)
def test_content_bug_passes_the_audit_and_fails_the_shadow(
    monkeypatch: pytest.MonkeyPatch, bug: str
) -> None:
    CONTENT_BUGS[bug](monkeypatch)
    traffic(AuditOnly)  # reference counts all add up: the audit alone cannot see it
    with pytest.raises(ShadowViolation) as info:
        traffic(CheckedKV)
    assert "holds" in str(info.value) and "A1" not in str(info.value)


def test_out_of_window_release_one_page_early_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    original = manager_module.first_window_page
    monkeypatch.setattr(manager_module, "first_window_page",
                        lambda end, window, page_size: original(end + page_size, window, page_size))

    with pytest.raises(ShadowViolation) as info:
        traffic(ShadowOnly)  # A4 sees it too; here the shadow's read check at the forward does
    assert "reads key" in str(info.value) and "swa table (NULL)" in str(info.value)


def test_double_decref_is_caught_after_the_call() -> None:
    engine = make_engine(Setup(1, 6, full_pages=64, chunk=8))
    submit(engine, "r1", S[:10], 5)
    step(engine)
    kv: KVManager = engine.kv
    page = int(kv.page_tables("r1")[0][0])
    kv.full_pool.decref([page])  # one holder released twice (the tree's and r1's count: 2 -> 0)
    kv.full_pool.decref([page])
    with pytest.raises(ShadowViolation) as info:
        step(engine)
    assert f"[A1] full page {page} " in str(info.value)  # freed under its holders, handed out again
