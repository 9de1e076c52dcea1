"""Recurrent-state snapshots in the radix tree (hybrid models): where they are taken, which are
kept, which go first.

A hybrid model's request state summarises every token so far, so a prefix hit needs the state at
exactly the hit's end: a *snapshot*, one state slot held by the tree entry ending there (the
tree holds the reference: `Node.state`, `RadixTree.owned("state")`; kv/tree.py). This module
owns the policy over them and changes nothing but snapshots: no page, no request table, no
tensor (the manager copies states, kv/manager.py):

- `plan_snapshot_points`: where a request's prompt chunks should end so that its state is there
  at the end of a step (a snapshot can only be taken of where the state *is*);
- `take_snapshot`: the tree's slot for a snapshot at a committed position (allocated here,
  evicting others when none is free; none to be had: no snapshot, never a failed request);
- `drop_passing_snapshot`: a request keeps only its latest snapshot at no planned point;
- `evict_snapshots`: dropped alone, by tier (`snapshot_tiers`), oldest first within a tier.
"""

from __future__ import annotations

from collections.abc import Sequence

from freetoken.kv.tree import Node, RadixTree, Tokens
from freetoken.kv.window import floor_to_page


def plan_snapshot_points(
    tree: RadixTree, tokens: Tokens, cached: int, boundaries: Sequence[int], prompt_len: int, interval: int
) -> tuple[int, ...]:
    """The page-aligned positions in (cached, cap] where a request's prompt chunks should end:
    each marked boundary floored to a page, the resend cap floor_to_page(prompt_len - 1), the
    end of the tree's path of `tokens` (a branch point once this request commits past it) and
    every `interval` tokens (0: none)."""
    p = tree.page_size
    cap = floor_to_page(prompt_len - 1, p) if prompt_len > 1 else 0
    wanted = {floor_to_page(b, p) for b in boundaries}
    wanted.add(cap)
    wanted.add(min(cap, tree.path_pages(tokens, prompt_len // p) * p))
    if interval > 0:
        step = max(p, floor_to_page(interval, p))
        wanted.update(range(step, cap, step))
    return tuple(sorted(s for s in wanted if cached < s <= cap))


def _entry_at(tree: RadixTree, tokens: Tokens, end: int) -> tuple[Node, int] | None:
    """The tree entry ending at `end` (page-aligned) on the path of `tokens`."""
    p = tree.page_size
    if end <= 0 or end % p:
        return None
    entries = tree._walk(tokens, end // p)
    return entries[-1] if entries and len(entries) * p == end else None


def snapshot_at(tree: RadixTree, tokens: Tokens, end: int) -> int:
    """The snapshot slot at `end` on the path of `tokens`; 0: none."""
    entry = _entry_at(tree, tokens, end)
    return entry[0].state[entry[1]] if entry else 0


def take_snapshot(tree: RadixTree, tokens: Tokens, end: int) -> int:
    """A state slot of the tree's own for a snapshot at `end` (on the committed path of
    `tokens`), evicting a snapshot when the pool has no free slot. Returns the slot for the
    caller to fill with the state after token `end - 1`, or 0: no entry ends there, it already
    has a snapshot (the tree keeps its own), or no slot could be had."""
    entry = _entry_at(tree, tokens, end)
    pool = tree.state_pool
    if pool is None or entry is None or entry[0].state[entry[1]]:
        return 0
    if pool.num_free < 1:
        evict_snapshots(tree, 1)
    got = pool.alloc(1)
    if not got:
        return 0
    tree.hold_snapshot(entry[0], entry[1], got[0])
    return got[0]


def kept_point(node: Node, j: int) -> bool:
    """Entry j ends at a branch point or a marked boundary."""
    return j == node.npages - 1 and (node.marked or len(node.children) >= 2)


def drop_passing_snapshot(tree: RadixTree, tokens: Tokens, end: int, slot: int) -> bool:
    """Drop the snapshot `slot` at `end` on the path of `tokens` unless it has become worth
    keeping (a branch point or a marked boundary): a request's snapshot at no planned point,
    superseded by its next one. False when it is not there (evicted meanwhile) or kept."""
    entry = _entry_at(tree, tokens, end)
    if entry is None or entry[0].state[entry[1]] != slot or kept_point(*entry):
        return False
    tree.drop("state", [slot])
    return True


def snapshot_tiers(tree: RadixTree) -> dict[tuple[Node, int], int]:
    """Eviction tier of every snapshot, lowest evicted first: 0 a snapshot with another one
    further down its path (a continuation hits there instead), 1 such a snapshot at a marked
    boundary (a fork there, an edited message, still hits it), 2 the last snapshot of its path
    (where the next request of a conversation hits), 3 a branch point (every fork hits it)."""
    below: dict[Node, bool] = {}  # a snapshot somewhere under the node's end
    for node in reversed(list(tree.nodes())):  # children before parents
        below[node] = any(below[c] or any(c.state) for c in node.children.values())
    tiers: dict[tuple[Node, int], int] = {}
    for node in dict.fromkeys(tree.owned("state").values()):
        for j, slot in enumerate(node.state):
            if not slot:
                continue
            if j == node.npages - 1 and len(node.children) >= 2:
                tiers[(node, j)] = 3
            elif not (any(node.state[j + 1 :]) or below[node]):
                tiers[(node, j)] = 2
            else:
                tiers[(node, j)] = 1 if kept_point(node, j) else 0
    return tiers


def evict_snapshots(tree: RadixTree, need: int, keep: int = 0, pinned_too: bool = False) -> int:
    """Drop up to `need` snapshots alone (their entries and pages stay): by tier, then least
    recently used, then earliest position; snapshots of pinned nodes only with `pinned_too` (a
    request needs the slot: a pin never starves one); never the slot `keep`. Returns the slots
    freed. Slots are few (a few per conversation), so the tier comes before age."""
    pool = tree.state_pool
    if pool is None or need <= 0:
        return 0
    now = tree.clock()
    tiers = snapshot_tiers(tree)
    cands = []
    for s, n in tree.owned("state").items():
        if pool.rc[s] == 1 and s != keep and (pinned_too or n.pin_until <= now):
            j = n.state.index(s)
            cands.append(((tiers[(n, j)], n.last_access, n.start + j * tree.page_size, n.uid), s))
    cands.sort()
    victims = [s for _, s in cands[:need]]
    tree.drop("state", victims)
    return len(victims)


def evictable_snapshots(tree: RadixTree) -> int:
    """Snapshot slots `evict_snapshots(..., pinned_too=True)` could free now."""
    pool = tree.state_pool
    return 0 if pool is None else sum(1 for s in tree.owned("state") if pool.rc[s] == 1)
