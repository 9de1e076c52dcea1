"""Why a prompt's prefix-cache hit stopped where it did (the cache report's miss reason).

Owns `CacheMiss` (tokens the tree matched, the reason) and `EvictedPaths`, a bounded record of
the page paths the tree dropped, so that "the tree once held the next page" can be told
from "no cached path goes further". It reads the radix tree and changes nothing in it: no count,
no node, no access stamp. Reasons, in the order they are decided:

- `capped`: the hit is as long as the cap allows (the last token, and so the last partial
  page, is always computed);
- `state_missing`: (hybrid models) the tree holds more whole pages of the prompt, but no
  recurrent-state snapshot at the end of any longer prefix (never taken there, or evicted);
- `window_evicted`: the tree holds more whole pages of the prompt, but the sliding window
  before every longer prefix has a tombstone;
- `evicted`: the tree's path ends at the hit and the next page of the prompt was in the tree
  until full eviction, a pool shrink or a quarantine removed it;
- `diverged_at_token N`: no cached path goes further; token N of the prompt is the first that
  no cached path holds.

With a disk tier (kv/disk_tier.py) the explanation is made after its load, and one more reason
is given by the tier itself: `on_disk`: the disk held more pages of the prompt but they were not
loaded (recomputing them was measured cheaper, no pages were free for them, or a file failed its
checks); `evicted` then means that the pages are gone from the disk too (or were never written).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from freetoken.kv.window import floor_to_page

if TYPE_CHECKING:
    from freetoken.kv.tree import Node, RadixTree

REASONS = ("capped", "state_missing", "window_evicted", "evicted", "on_disk", "diverged")  # the metric's label values


@dataclass(frozen=True)
class CacheMiss:
    """`matched`: prompt tokens (whole pages) whose FULL pages the tree held at admission."""

    matched: int
    reason: str

    @property
    def label(self) -> str:
        """The reason without its token position (a bounded metric label)."""
        return self.reason.split("_at_token", 1)[0]


def page_hashes(tokens: Sequence[int], page_size: int, base: int = 0) -> list[int]:
    """Chained hashes of whole pages: entry i identifies tokens[: (i + 1) * P] exactly enough for
    a diagnostic (a collision can only mislabel a reason, never change a hit)."""
    out: list[int] = []
    h = base
    for i in range(len(tokens) // page_size):
        h = hash((h, tuple(tokens[i * page_size : (i + 1) * page_size])))
        out.append(h)
    return out


class EvictedPaths:
    """The last `limit` page prefixes full eviction removed (oldest forgotten first)."""

    def __init__(self, limit: int) -> None:
        self.limit = max(1, limit)
        self._seen: OrderedDict[int, None] = OrderedDict()

    def add(self, hashes: Sequence[int]) -> None:
        for h in hashes:
            self._seen[h] = None
            self._seen.move_to_end(h)
        while len(self._seen) > self.limit:
            self._seen.popitem(last=False)

    def __contains__(self, h: int) -> bool:
        return h in self._seen


def path_tokens(node: Node) -> list[int]:
    """The tokens from the root to the end of `node`."""
    keys: list[tuple[int, ...]] = []
    cur: Node | None = node
    while cur is not None and cur.parent is not None:
        keys.append(cur.key)
        cur = cur.parent
    return [t for key in reversed(keys) for t in key]


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def divergence(tree: RadixTree, tokens: Sequence[int]) -> int:
    """The first position of `tokens` that no path of the tree holds (token by token)."""
    node, pos = tree.root, 0
    while pos < len(tokens):
        best, best_len = None, 0
        for child in node.children.values():
            n = _common(child.key, tokens[pos : pos + len(child.key)])
            if n > best_len:
                best, best_len = child, n
        if best is None:
            break
        pos += best_len
        if best_len < len(best.key):
            break
        node = best
    return pos


def explain(
    tree: RadixTree, evicted: EvictedPaths, tokens: Sequence[int], hit: int, needs_state: bool = False
) -> CacheMiss:
    """Why the hit for `tokens` is `hit` tokens long (called at admission, right after the
    match, before anything else changes the tree); `needs_state`: a hybrid model, whose hit also
    needs a state snapshot at its end."""
    p = tree.page_size
    cap = floor_to_page(len(tokens) - 1, p) if len(tokens) > 1 else 0
    matched = len(tree._walk(tuple(tokens), len(tokens) // p)) * p
    if hit >= cap:
        return CacheMiss(matched, "capped")
    if matched > hit:
        return CacheMiss(matched, "state_missing" if needs_state else "window_evicted")
    if page_hashes(tokens[: hit + p], p)[-1] in evicted:  # cap > hit: that page exists
        return CacheMiss(matched, "evicted")
    return CacheMiss(matched, f"diverged_at_token {divergence(tree, tokens)}")
