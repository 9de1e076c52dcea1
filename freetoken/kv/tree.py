"""The radix tree of pages: the prefix cache, one ordinary holder of page references.

Owns the tree's nodes and the tree's references: each node entry holds one reference to its
FULL page and, when live, one to its SWA page (SWA entry 0 = tombstone: the full page stays
reusable by full-attention layers, not by SWA layers). It must not touch a request's page table
and must not release any reference but its own (DESIGN.md §3, rules 3, 4 and 6):

- `match` decides how much of a new prompt is reusable (the hit rule) and returns the pages;
  it changes no count (the manager takes the request's references before anyone else runs);
- `insert` (commit) only adds the tree's references: new nodes and healed tombstones;
- `evict_swa` / `evict_full` drop only the tree's references, oldest first, skipping entries a
  request still holds (evicting them would free nothing) and nodes pinned until later than now
  (a retention pin, kv/pins.py: `pin_until` on the clock the manager gives the tree; a hit
  renews it).

Hybrid models (a state pool: the recurrent state of every linear-attention layer, one slot per
position): an entry may also hold a *snapshot*, one state slot with the state after the last
token of that entry's page, the tree's own reference, never written after it is taken; a hit on
such a model needs a snapshot at exactly its end. Removing an entry releases its snapshot, and
`drop("state", ...)` drops snapshots alone (the entry and its pages stay). Which snapshots are
taken, kept and evicted first is kv/snapshots.py (`ends` and `waiting` are its records of which
snapshots are a request's ends; the tree only forgets a slot there when the slot leaves it).

Nodes are split at page boundaries only, so every node holds whole pages.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from freetoken.kv.miss import EvictedPaths, page_hashes, path_tokens
from freetoken.kv.pool import PagePool
from freetoken.kv.window import first_window_page, floor_to_page, hit_length

Tokens = tuple[int, ...]


@dataclass(eq=False)
class Node:
    """A run of whole pages; `key` are its tokens, entries are per page."""

    uid: int
    start: int  # absolute position of key[0]
    key: Tokens  # len(key) == len(full) * page_size
    full: list[int]  # FULL page per entry, never NULL
    swa: list[int]  # SWA page per entry, 0 = tombstone (all 0 without an SWA pool)
    pri: list[bool]  # entry is in a window before a branch point or marked boundary
    parent: Node | None
    children: dict[Tokens, Node] = field(default_factory=dict)  # keyed by first page's tokens
    last_access: int = 0
    marked: bool = False  # a request marked a boundary at this node's end
    live: int = 0  # number of live SWA entries
    pin_until: float = 0.0  # retention pin: eviction skips the node while the clock is before it
    pin_ttl: float = 0.0  # how long a hit renews the pin for
    state: list[int] = field(default_factory=list)  # state slot per entry (its snapshot), 0 = none

    @property
    def npages(self) -> int:
        return len(self.full)

    @property
    def end(self) -> int:
        return self.start + len(self.key)


@dataclass(frozen=True)
class TreeMatch:
    """A hit: `length` tokens; the pages a lease must take (SWA: 0 outside the window); `state`:
    the snapshot at `length` whose copy a hybrid model's request starts from (0: none)."""

    length: int
    full: list[int]
    swa: list[int] | None
    state: int = 0


class RadixTree:
    """Prefix cache over one FULL pool and an optional SWA pool."""

    def __init__(
        self,
        full_pool: PagePool,
        swa_pool: PagePool | None,
        page_size: int,
        window: int | None,
        state_pool: PagePool | None = None,
    ) -> None:
        self.full_pool = full_pool
        self.swa_pool = swa_pool
        self.state_pool = state_pool
        self.page_size = page_size
        self.window = window
        self._uids = itertools.count(1)
        self.root = Node(0, 0, (), [], [], [], None)
        self._clock = 0
        # Ordered sets (dicts), so that eviction order never depends on object addresses.
        self._leaves: dict[Node, None] = {}
        self._swa_nodes: dict[Node, None] = {}  # nodes with a live SWA entry
        self._full_at: dict[int, Node] = {}
        self._swa_at: dict[int, Node] = {}
        self._state_at: dict[int, Node] = {}  # snapshot slot -> its node
        # Snapshot slot -> the request (a serial) whose end it is: where that request's successor
        # hits, and the serials of requests still waiting (kv/snapshots.py's records; a slot
        # leaving the tree leaves `ends` too).
        self.ends: dict[int, int] = {}
        self.waiting: set[int] = set()
        self.evicted = EvictedPaths(4 * full_pool.capacity)  # for the cache report's miss reason
        self.clock: Callable[[], float] = time.monotonic  # the pins' clock (tests give a fake one)
        self.swa_pinned: dict[int, float] = {}  # SWA page -> pin deadline (the window before a pin's end)

    # -- bookkeeping ------------------------------------------------------------------------

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _refresh(self, node: Node) -> None:
        if node is self.root or node.parent is None:
            self._leaves.pop(node, None)
            self._swa_nodes.pop(node, None)
            return
        if node.children:
            self._leaves.pop(node, None)
        else:
            self._leaves[node] = None
        if node.live > 0:
            self._swa_nodes[node] = None
        else:
            self._swa_nodes.pop(node, None)

    def nodes(self) -> Iterator[Node]:
        """Every node but the root, parents before children."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def num_pages(self, kind: str) -> int:
        """Pages (state: slots) the tree references in pool `kind`."""
        return len(self.owned(kind))

    def owned(self, kind: str) -> dict[int, Node]:
        """The tree's pages (state: snapshot slots) of pool `kind`, each with its node."""
        return self._full_at if kind == "full" else self._swa_at if kind == "swa" else self._state_at

    @staticmethod
    def _entries(node: Node, kind: str) -> list[int]:
        return node.full if kind == "full" else node.swa if kind == "swa" else node.state

    def where(self, kind: str, page: int) -> str | None:
        """Describe the tree entry holding `page`, for error reports."""
        node = self.owned(kind).get(page)
        if node is None:
            return None
        entries = self._entries(node, kind)
        j = entries.index(page) if page in entries else -1
        return f"tree node#{node.uid} [{node.start},{node.end}) entry {j}"

    # -- walking ----------------------------------------------------------------------------

    def _common_pages(self, node: Node, tokens: Tokens, pos: int, limit: int) -> int:
        p = self.page_size
        m = min(node.npages, (limit - pos) // p)
        if node.key[: m * p] == tokens[pos : pos + m * p]:
            return m
        j = 0
        while j < m and node.key[j * p : (j + 1) * p] == tokens[pos + j * p : pos + (j + 1) * p]:
            j += 1
        return j

    def _walk(self, tokens: Tokens, max_pages: int) -> list[tuple[Node, int]]:
        """Tree entries (node, index) for pages 0.. of `tokens` that exist, at most max_pages."""
        p = self.page_size
        out: list[tuple[Node, int]] = []
        node, pos, limit = self.root, 0, max_pages * p
        while pos < limit:
            child = node.children.get(tokens[pos : pos + p])
            if child is None:
                break
            m = self._common_pages(child, tokens, pos, limit)
            out.extend((child, j) for j in range(m))
            pos += m * p
            if m < child.npages:
                break
            node = child
        return out

    def _hit(self, tokens: Tokens) -> tuple[list[tuple[Node, int]], int, int]:
        """The entries of a new prompt's path under its cap, the hit's length (cap first, then
        the largest L whose window is live) and the snapshot at its end (0: none)."""
        p = self.page_size
        cap = floor_to_page(len(tokens) - 1, p) // p if len(tokens) > 1 else 0
        entries = self._walk(tokens, cap)
        live = None if self.swa_pool is None else [n.swa[j] != 0 for n, j in entries]
        snaps = None if self.state_pool is None else [n.state[j] != 0 for n, j in entries]
        length = hit_length(len(entries), live, len(tokens), p, self.window, snaps)
        k = length // p
        state = entries[k - 1][0].state[entries[k - 1][1]] if snaps is not None and k else 0
        return entries, length, state

    def peek(self, tokens: Tokens) -> int:
        """The snapshot a `match` of `tokens` would start from now (0: none); changes nothing
        (no stamp, no pin renewed)."""
        return self._hit(tokens)[2]

    def match(self, tokens: Tokens) -> TreeMatch:
        """The hit for a new prompt (cap first, then the largest L whose window is live)."""
        p = self.page_size
        entries, length, state = self._hit(tokens)
        k = length // p
        stamp = self._tick()
        now = self.clock()
        for node, _ in entries[:k]:
            node.last_access = stamp
            if node.pin_until > now:  # a hit renews a live pin, its window's SWA entries too
                node.pin_until = now + node.pin_ttl
                for s in node.swa:
                    if self.swa_pinned.get(s, 0.0) > now:
                        self.swa_pinned[s] = node.pin_until
        full = [n.full[j] for n, j in entries[:k]]
        if self.swa_pool is None or self.window is None:
            return TreeMatch(length, full, None, state)
        first = first_window_page(length, self.window, p)
        swa = [n.swa[j] if i >= first else 0 for i, (n, j) in enumerate(entries[:k])]
        return TreeMatch(length, full, swa, state)

    def path_pages(self, tokens: Tokens, max_pages: int) -> int:
        """Whole pages of `tokens` (at most max_pages) the tree holds: where its path ends."""
        return len(self._walk(tokens, max_pages))

    def touch(self, tokens: Tokens) -> None:
        """Stamp the path of `tokens` as just used (a preempted request's resume hits it)."""
        stamp = self._tick()
        for node, _ in self._walk(tokens, len(tokens) // self.page_size):
            node.last_access = stamp

    # -- structure --------------------------------------------------------------------------

    def _split(self, node: Node, m: int) -> Node:
        """Cut `node` after m pages (0 < m < npages); returns the new upper node."""
        p = self.page_size
        if node.parent is None:
            raise ValueError("cannot split the root or a detached node")
        upper = Node(
            next(self._uids),
            node.start,
            node.key[: m * p],
            node.full[:m],
            node.swa[:m],
            node.pri[:m],
            node.parent,
            last_access=node.last_access,
            pin_until=node.pin_until,
            pin_ttl=node.pin_ttl,
            state=node.state[:m],
        )
        upper.live = sum(1 for s in upper.swa if s)
        node.key, node.full, node.swa, node.pri = (node.key[m * p :], node.full[m:], node.swa[m:], node.pri[m:])
        node.state = node.state[m:]
        node.start += m * p
        node.live -= upper.live
        node.parent.children[upper.key[:p]] = upper
        upper.children[node.key[:p]] = node
        node.parent = upper
        for page in upper.full:
            self._full_at[page] = upper
        for page in upper.swa:
            if page:
                self._swa_at[page] = upper
        for slot in upper.state:
            if slot:
                self._state_at[slot] = upper
        self._refresh(upper)
        self._refresh(node)
        return upper

    def _add_leaf(self, parent: Node, tokens: Tokens, pos: int, full: Sequence[int], stamp: int) -> None:
        p = self.page_size
        pages: list[int] = []
        for i in range(pos // p, len(tokens) // p):
            page = int(full[i])
            if page == 0 or page in self._full_at:
                what = "NULL" if page == 0 else "already in the tree"
                raise self.full_pool.integrity_error("tree", page, f"commit of a page {what}")
            if not self.full_pool.usable(page):
                break  # never give the tree a quarantined or retiring page; the path stops before it
            pages.append(page)
        if not pages:
            return
        self.full_pool.incref(pages)
        k = len(pages)
        node = Node(
            next(self._uids),
            pos,
            tokens[pos : pos + k * p],
            pages,
            [0] * k,
            [False] * k,
            parent,
            last_access=stamp,
            state=[0] * k,
        )
        for page in pages:
            self._full_at[page] = node
        parent.children[node.key[:p]] = node
        self._refresh(parent)
        self._refresh(node)

    def _mark(self, tokens: Tokens, end: int) -> None:
        """Make a node end at `end` (page-aligned, on the path of tokens) and mark it."""
        entries = self._walk(tokens, end // self.page_size)
        if len(entries) * self.page_size < end:
            return
        node, j = entries[-1]
        if j + 1 < node.npages:
            node = self._split(node, j + 1)
        node.marked = True

    def insert(
        self,
        tokens: Tokens,
        full: Sequence[int],
        swa: Sequence[int] | None,
        boundaries: Sequence[int] = (),
        resend_at: int | None = None,
    ) -> None:
        """Commit: the tree takes its own references to a request's written pages.

        `tokens` is page-aligned; `full[i]` / `swa[i]` are the request's pages for page i. Where
        the tree already has an entry it keeps its own page (the request keeps its duplicate);
        new pages get a new node. SWA entries are kept live (healing tombstones with the
        request's live page) only in the window before the end of `tokens`, before `resend_at`
        (floored to a page: where a resend of the request's prompt hits, for it must compute its
        last token), before every branch point of the path and before every marked boundary;
        older ones are stored as tombstones.
        Nothing is released and the request's table is not touched.
        """
        p = self.page_size
        n = floor_to_page(len(tokens), p)
        tokens = tokens[:n]
        if n == 0:
            return
        stamp = self._tick()
        node, pos = self.root, 0
        while pos < n:
            child = node.children.get(tokens[pos : pos + p])
            if child is None:
                self._add_leaf(node, tokens, pos, full, stamp)
                break
            m = self._common_pages(child, tokens, pos, n)
            if m < child.npages:
                if pos + m * p == n:
                    child.last_access = stamp
                    break
                child = self._split(child, m)
            child.last_access = stamp
            pos += m * p
            node = child
        for b in sorted({floor_to_page(b, p) for b in boundaries}):
            if 0 < b <= n:
                self._mark(tokens, b)
        if self.swa_pool is None or self.window is None or swa is None:
            return
        entries = self._walk(tokens, n // p)
        end = len(entries) * p
        anchors = {end: False}
        if resend_at is not None and 0 < floor_to_page(resend_at, p) < end:
            # A page-aligned prompt sent again hits one page short of its end (hit_length's cap):
            # without that window such a prompt longer than the window would never hit again.
            anchors[floor_to_page(resend_at, p)] = False
        for nd in dict.fromkeys(e[0] for e in entries):
            if nd.end <= end and (nd.marked or len(nd.children) >= 2):
                anchors[nd.end] = True
        keep: dict[int, bool] = {}
        for e, pri in anchors.items():
            for i in range(first_window_page(e, self.window, p), e // p):
                keep[i] = keep.get(i, False) or pri
        for i in sorted(keep):
            nd, j = entries[i]
            if keep[i]:
                nd.pri[j] = True
            page = int(swa[i])
            if nd.swa[j] or page == 0 or not self.swa_pool.usable(page):
                continue
            if page in self._swa_at:
                raise self.swa_pool.integrity_error("tree", page, "heal with a page already in the tree")
            self.swa_pool.incref([page])
            nd.swa[j] = page
            nd.live += 1
            self._swa_at[page] = nd
            self._refresh(nd)

    # -- removal ----------------------------------------------------------------------------

    def _trim_tail(self, node: Node, k: int) -> int:
        """Drop the tree's references of the last k entries of a leaf; returns full pages freed."""
        full, swa = node.full[-k:], [s for s in node.swa[-k:] if s]
        state = [s for s in node.state[-k:] if s]
        for page in full:
            del self._full_at[page]
        for page in swa:
            del self._swa_at[page]
            self.swa_pinned.pop(page, None)
        for slot in state:
            del self._state_at[slot]
            self.ends.pop(slot, None)
        if k == node.npages and node.parent is not None:
            del node.parent.children[node.key[: self.page_size]]
            self._refresh(node.parent)
            node.parent = None
            node.live = 0
            self._refresh(node)
        else:
            p = self.page_size
            node.key, node.full = node.key[: -k * p], node.full[:-k]
            node.swa, node.pri = node.swa[:-k], node.pri[:-k]
            node.state = node.state[:-k]
            node.live -= len(swa)
            node.marked = False
            self._refresh(node)
        if self.swa_pool is not None:
            self.swa_pool.decref(swa)
        if self.state_pool is not None:
            self.state_pool.decref(state)
        return self.full_pool.decref(full)

    def evict_full(self, need: int) -> int:
        """Full pass: remove tree-only pages from leaves, oldest first; returns pages freed."""
        rc = self.full_pool.rc
        now = self.clock()
        heap = [(n.last_access, n.uid, n) for n in self._leaves]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < need:
            _, _, node = heapq.heappop(heap)
            if node.parent is None or node.children or node.pin_until > now:
                continue
            k = 0
            while k < node.npages and rc[node.full[-1 - k]] == 1:
                k += 1
            if k == 0:
                continue
            parent = node.parent
            whole = k == node.npages
            self.evicted.add(page_hashes(path_tokens(node), self.page_size)[-k:])
            freed += self._trim_tail(node, k)
            if whole and parent is not self.root and not parent.children:
                heapq.heappush(heap, (parent.last_access, parent.uid, parent))
        return freed

    def evict_swa(self, need: int) -> int:
        """SWA pass: turn tree-only live SWA entries into tombstones; returns pages freed.

        Order: entries outside protected windows first, then least recently used, then earliest
        position. Protection is set at commit and is not withdrawn when a branch disappears.
        """
        if self.swa_pool is None or need <= 0:
            return 0
        rc = self.swa_pool.rc
        now = self.clock()
        cands = [
            (n.pri[j], n.last_access, n.start + j * self.page_size, n.uid, j, n)
            for n in self._swa_nodes
            for j, s in enumerate(n.swa)
            if s and rc[s] == 1 and self.swa_pinned.get(s, 0.0) <= now
        ]
        cands.sort(key=lambda c: c[:5])
        victims: list[int] = []
        for *_, j, node in cands[:need]:
            page = node.swa[j]
            node.swa[j] = 0
            node.live -= 1
            del self._swa_at[page]
            self._refresh(node)
            victims.append(page)
        return self.swa_pool.decref(victims)

    # -- state snapshots (hybrid models; which and when: kv/snapshots.py) ------------------

    def hold_snapshot(self, node: Node, j: int, slot: int) -> None:
        """Entry j of `node` holds `slot` (just allocated: the reference is the tree's)."""
        if node.state[j] or slot in self._state_at:
            raise self.state_pool.integrity_error("tree", slot, "snapshot on an entry that has one")  # type: ignore[union-attr]
        node.state[j] = slot
        self._state_at[slot] = node

    def move_snapshot(self, old: int, new: int) -> None:
        """The snapshot in `old` now lives in `new` (just allocated for the tree, the state copied
        there by the caller): the entry holds `new` and the tree releases `old` (a state pool
        shrink moves the snapshots it keeps below its target)."""
        assert self.state_pool is not None
        node = self._state_at.get(old)
        if node is None or new in self._state_at:
            raise self.state_pool.integrity_error("tree", old, f"move of a snapshot the tree does not hold to {new}")
        del self._state_at[old]
        node.state[node.state.index(old)] = new
        self._state_at[new] = node
        if old in self.ends:
            self.ends[new] = self.ends.pop(old)
        self.state_pool.decref([old])

    def _drop_snapshots(self, slots: Sequence[int]) -> None:
        for slot in slots:
            node = self._state_at.pop(slot)
            node.state[node.state.index(slot)] = 0
            self.ends.pop(slot, None)

    def evictable_full(self) -> int:
        """FULL pages repeated full passes could free now: tree-only pages with no
        request-held page below them in their subtree."""
        rc = self.full_pool.rc
        now = self.clock()
        clean: dict[Node, bool] = {}
        total = 0
        for node in reversed(list(self.nodes())):  # children before parents
            if node.pin_until > now:
                clean[node] = False
            elif all(clean[c] for c in node.children.values()):
                run = 0
                while run < node.npages and rc[node.full[-1 - run]] == 1:
                    run += 1
                total += run
                clean[node] = run == node.npages
            else:
                clean[node] = False
        return total

    def evictable_swa(self) -> int:
        """SWA pages the SWA pass could free now (live tree entries no request holds)."""
        if self.swa_pool is None:
            return 0
        rc = self.swa_pool.rc
        now = self.clock()
        pinned = self.swa_pinned
        return sum(1 for n in self._swa_nodes for s in n.swa if s and rc[s] == 1 and pinned.get(s, 0.0) <= now)

    def pages_above(self, kind: str, limit: int) -> list[int]:
        """The tree's pages of pool `kind` with an index above `limit` (a shrink drops them)."""
        return sorted(p for p in self.owned(kind) if p > limit)

    def drop(self, kind: str, pages: Sequence[int]) -> None:
        """Quarantine support: drop every tree entry on `pages` (a FULL entry takes the rest of
        its path with it; an SWA entry becomes a tombstone; a state slot: the snapshot alone)."""
        if kind == "state":
            held = [s for s in pages if s in self._state_at]
            self._drop_snapshots(held)
            if self.state_pool is not None:
                self.state_pool.decref(held)
            return
        for page in pages:
            if kind == "swa":
                node = self._swa_at.pop(page, None)
                if node is None or self.swa_pool is None:
                    continue
                node.swa[node.swa.index(page)] = 0
                node.live -= 1
                self.swa_pinned.pop(page, None)
                self._refresh(node)
                self.swa_pool.decref([page])
                continue
            node = self._full_at.get(page)
            if node is None:
                continue
            j = node.full.index(page)
            if j > 0:
                self._split(node, j)  # `node` keeps the entries from j on
            self._remove_subtree(node)

    def _remove_subtree(self, top: Node) -> None:
        doomed, stack = [], [top]
        while stack:
            node = stack.pop()
            doomed.append(node)
            stack.extend(node.children.values())
        for node in reversed(doomed):  # children first, so each is a leaf when trimmed
            self.evicted.add(page_hashes(path_tokens(node), self.page_size)[-node.npages :])
            self._trim_tail(node, node.npages)
