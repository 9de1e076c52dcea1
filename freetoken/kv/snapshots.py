"""Recurrent-state snapshots in the radix tree (hybrid models): where they are taken, which are
kept, which go first.

A hybrid model's request state summarises every token so far, so a prefix hit needs the state at
exactly the hit's end: a *snapshot*, one state slot held by the tree entry ending there (the
tree holds the reference: `Node.state`, `RadixTree.owned("state")`; kv/tree.py). This module
owns the policy over them and changes nothing but snapshots and their record of ends
(`RadixTree.ends`): no page, no request table, no tensor (the manager copies states,
kv/manager.py):

- `plan_snapshot_points`: where a request's prompt chunks should end so that its state is there
  at the end of a step (a snapshot can only be taken of where the state *is*);
- `take_snapshot`: the tree's slot for a snapshot at a committed position (allocated here,
  evicting others when none is free; none to be had: no snapshot, never a failed request);
- `drop_passing_snapshot`: a request keeps only its latest snapshot at no planned point;
- `set_ends` / `end_consumed`: a request's *ends*, the snapshots where the next request of its
  conversation hits: at its resend cap (the end of its prompt: a chat template that renders the
  reply differently, e.g. without its reasoning, leaves the path there) and the deepest one on
  its path (the last page boundary of its reply, when the next request repeats the reply
  token for token). One of the two is wasted, and which one is not known until the next request
  comes: that request's hit on either ends both (`end_consumed`);
- `evict_snapshots`: dropped alone, by tier (`snapshot_tiers`), oldest first within a tier;
- `fit_snapshots`: before the state pool shrinks, the snapshots that fit below its new size are
  kept (the others evicted in that order) and moved there.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

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


def request_ends(tree: RadixTree, tokens: Tokens, cap: int) -> list[int]:
    """A request's ends on the path of `tokens` (its committed tokens, or its hit): the
    snapshot at its resend `cap` and the deepest snapshot on the path (one slot when they are
    the same)."""
    entries = tree._walk(tokens, len(tokens) // tree.page_size)
    ends: list[int] = []
    for k in range(len(entries), 0, -1):
        node, j = entries[k - 1]
        if node.state[j]:
            ends.append(node.state[j])
            break
    at_cap = snapshot_at(tree, tokens, cap) if 0 < cap <= len(tokens) else 0
    if at_cap and at_cap not in ends:
        ends.append(at_cap)
    return ends


def set_ends(tree: RadixTree, request: int, slots: Sequence[int]) -> None:
    """The ends of `request` (a serial, never reused) are `slots` now, and no other slot."""
    for slot in [s for s, r in tree.ends.items() if r == request and s not in slots]:
        del tree.ends[slot]
    for slot in slots:
        tree.ends[slot] = request


def end_consumed(tree: RadixTree, slot: int) -> None:
    """A new request hit the snapshot `slot`: if it is a request's end, that request's other end
    will not be hit by its conversation (the next request went the other way), so none of its
    ends is one any more; the new request's own ends replace them."""
    request = tree.ends.get(slot)
    if request is not None:
        set_ends(tree, request, ())


def snapshot_tiers(tree: RadixTree) -> dict[tuple[Node, int], int]:
    """Eviction tier of every snapshot, lowest evicted first: 0 the rest (one with a snapshot
    further down its path, an end whose conversation went on past it or the other way, a fork
    with at most one live side); 1 a marked boundary (a fork there, an edited message, still hits
    it); 2 a request's end (where the next request of its conversation may hit); 3 the end of a
    request still waiting (where it will hit) and a shared branch point: at least two of its
    children lead to ends (a new conversation hits it)."""
    ends, waiting = tree.ends, tree.waiting
    live: dict[Node, bool] = {}  # an end somewhere in the node's subtree (its own entries too)
    for node in reversed(list(tree.nodes())):  # children before parents
        live[node] = any(s in ends for s in node.state if s) or any(live[c] for c in node.children.values())
    tiers: dict[tuple[Node, int], int] = {}
    for node in dict.fromkeys(tree.owned("state").values()):
        last = node.npages - 1
        for j, slot in enumerate(node.state):
            if not slot:
                continue
            if ends.get(slot) in waiting or (j == last and sum(1 for c in node.children.values() if live[c]) >= 2):
                tiers[(node, j)] = 3
            elif slot in ends:
                tiers[(node, j)] = 2
            else:
                tiers[(node, j)] = 1 if j == last and node.marked else 0
    return tiers


def eviction_order(tree: RadixTree, keep: int = 0, pinned_too: bool = False) -> list[int]:
    """The snapshot slots `evict_snapshots` may drop, first to go first: by tier, then least
    recently used, then earliest position; snapshots of pinned nodes only with `pinned_too`;
    never the slot `keep`. Slots are few (a few per conversation), so the tier comes before age."""
    pool = tree.state_pool
    if pool is None:
        return []
    now = tree.clock()
    tiers = snapshot_tiers(tree)
    cands = []
    for s, n in tree.owned("state").items():
        if pool.rc[s] == 1 and s != keep and (pinned_too or n.pin_until <= now):
            j = n.state.index(s)
            cands.append(((tiers[(n, j)], n.last_access, n.start + j * tree.page_size, n.uid), s))
    cands.sort()
    return [s for _, s in cands]


def evict_snapshots(tree: RadixTree, need: int, keep: int = 0, pinned_too: bool = False) -> int:
    """Drop up to `need` snapshots alone (their entries and pages stay) in `eviction_order`
    (pinned ones only with `pinned_too`: a request needs the slot, and a pin never starves one).
    Returns the slots freed."""
    if tree.state_pool is None or need <= 0:
        return 0
    victims = eviction_order(tree, keep, pinned_too)[:need]
    tree.drop("state", victims)
    return len(victims)


def evictable_snapshots(tree: RadixTree) -> int:
    """Snapshot slots `evict_snapshots(..., pinned_too=True)` could free now."""
    pool = tree.state_pool
    return 0 if pool is None else sum(1 for s in tree.owned("state") if pool.rc[s] == 1)


def fit_snapshots(tree: RadixTree, target: int, copy: Callable[[int, int], None] | None) -> int:
    """Before the state pool shrinks to `target` slots: evict snapshots in eviction order until
    those left fit in the slots 1..target that no request holds, then shrink the pool and move
    each snapshot above the target into a free slot below it (`copy(src, dst)` copies the state;
    None: no tensors). Returns the slots above the target still held (by requests: they retire
    when released)."""
    pool = tree.state_pool
    assert pool is not None
    owned = tree.owned("state")
    room = sum(1 for s in pool.free_pages() if s <= target) + sum(1 for s in owned if s <= target)
    if len(owned) > room:
        evict_snapshots(tree, len(owned) - room, pinned_too=True)
    pool.shrink(target)
    for old in sorted(s for s in owned if s > target):
        got = pool.alloc(1)
        if not got:  # unreachable after the eviction above; the snapshot goes rather than stays
            tree.drop("state", [old])
            continue
        if copy is not None:
            copy(old, got[0])
        tree.move_snapshot(old, got[0])
    return pool.pending_release()
