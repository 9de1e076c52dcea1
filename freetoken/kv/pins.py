"""Retention pins: a prefix of the radix tree that eviction skips until a deadline.

Owns pinning a committed path (Anthropic `cache_control` breakpoints, OpenAI `prompt_cache_key`)
and the cap on pinned pages. A pin changes no reference count and no page: it sets `pin_until`
(and the `pin_ttl` a hit renews it by) on every node of the path from the root to the
breakpoint, splitting a node at the breakpoint's page so that nothing past it is pinned, and the
same deadline on the live SWA entries of the window before the breakpoint (`tree.swa_pinned`):
only that window, so that a pin holds at most ceil((W - 1) / P) + 1 SWA pages. The tree then
skips pinned nodes in the full pass and pinned SWA pages in the SWA pass, and in what admission
counts as evictable; an expired pin is simply a deadline in the past. Both pools have a cap
(FULL pages of pinned nodes, pinned SWA pages): a pin past either is refused whole. Only whole committed pages are pinned: a
breakpoint is floored to its page, and a path not (yet) in the tree pins nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

from freetoken.kv.tree import Node, RadixTree
from freetoken.kv.window import first_window_page


def pinned_pages(tree: RadixTree) -> int:
    """FULL pages of nodes whose pin has not expired."""
    now = tree.clock()
    return sum(n.npages for n in tree.nodes() if n.pin_until > now)


def pinned_swa_pages(tree: RadixTree) -> int:
    now = tree.clock()
    return sum(1 for until in tree.swa_pinned.values() if until > now)


def pin_path(
    tree: RadixTree, tokens: Sequence[int], end: int, ttl_s: float, max_pages: int, max_swa_pages: int
) -> int | None:
    """Pin the tree's path of `tokens[:end]` (floored to whole pages) for `ttl_s` seconds.

    Returns the tokens pinned; None when there is nothing to pin (no whole page, or the path is
    not all in the tree); 0 when pinning it would take the pinned pages past `max_pages` (the pin
    is refused; nothing changes)."""
    p = tree.page_size
    k = min(end, len(tokens)) // p
    key = tuple(tokens[: k * p])
    entries = tree._walk(key, k)
    if k == 0 or len(entries) < k:
        return None
    now = tree.clock()
    path = list(dict.fromkeys(n for n, _ in entries))
    node, j = entries[-1]
    new = sum(n.npages for n in path[:-1] if n.pin_until <= now)
    new += (j + 1) if node.pin_until <= now else 0
    window: list[int] = []
    if tree.window is not None:
        live = tree.swa_pinned
        window = [n.swa[i] for n, i in entries[first_window_page(k * p, tree.window, p) :] if n.swa[i]]
        new_swa = sum(1 for s in window if live.get(s, 0.0) <= now)
        if pinned_swa_pages(tree) + new_swa > max_swa_pages:
            return 0
    if pinned_pages(tree) + new > max_pages:
        return 0
    if j + 1 < node.npages:
        tree._split(node, j + 1)  # the upper part ends at the breakpoint; the rest stays unpinned
        path = list(dict.fromkeys(n for n, _ in tree._walk(key, k)))
    for n in path:
        n.pin_until = max(n.pin_until, now + ttl_s)
        n.pin_ttl = max(n.pin_ttl, ttl_s)
    for s in window:
        tree.swa_pinned[s] = max(tree.swa_pinned.get(s, 0.0), now + ttl_s)
    return k * p


def release_all(tree: RadixTree) -> int:
    """End every pin now; returns how many nodes were pinned."""
    now = tree.clock()
    pinned = [n for n in tree.nodes() if n.pin_until > now]
    for n in pinned:
        n.pin_until = 0.0
    tree.swa_pinned.clear()
    return len(pinned)


def live_pins(tree: RadixTree) -> list[Node]:
    """Nodes pinned now (for tests and status)."""
    now = tree.clock()
    return [n for n in tree.nodes() if n.pin_until > now]
