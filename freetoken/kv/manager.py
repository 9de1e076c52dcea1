"""KVManager: the API the engine calls for KV memory (DESIGN.md §3).

Owns the two page pools, the radix tree and every admitted request's page tables, and is the
only place where a request's references are taken or dropped. A hybrid model (linear-attention
layers, Qwen3.5) adds a state pool: slots holding the conv and recurrent states of every linear
layer, owned like pages (reference count, free list, audit, quarantine). A running request holds
one (taken by `extend` with its first pages, all-or-nothing, or by `admit` on a hit) and the
tree holds *snapshots*: copy-on-commit, a commit that finds the request's state at a page
boundary (`len(tokens)` page-aligned) has the tree take a slot of its own there and copies the
request's state into it; copy-on-hit, a hit (which on such a model needs a snapshot at exactly
its end) takes the request's own slot at admission and copies the snapshot into it. The copies
are `copy_state`, a callback into the physical tensors (kv/tensors.py) that whoever allocates
them sets; this module decides who holds which slot, and tells the snapshot policy each
request's ends (kv/snapshots.py: at each commit, at a hit, and at `expect` when it joins the
waiting queue). `chunk_end` tells the scheduler where a
prompt chunk must end so that the request's state is at a wanted snapshot point after some step
(marked boundaries, the resend cap, the tree's branch point, every `snapshot_interval` tokens).
It must not decide scheduling (who runs, who is preempted) and must not touch the physical K/V
tensors itself.

Every step of a request, in the order the engine calls it:

    kv.expect(rid, prompt)                    # joins the waiting queue (hybrids: its hit is kept)
    cached = kv.admit(rid, prompt)            # hit rule; takes the request's lease at once
    if not kv.extend(rid, cached + chunk):    # grow both tables; evicts as needed; all-or-nothing
        kv.release(rid)                       # does not fit: lease released in the same step
    full, swa = kv.page_tables(rid)           # int32 tables for the forward (0 = NULL), read once
                                              # the step's batch is final (after any extend_draft)
    ... forward writes K/V of the chunk, samples ...
    kv.commit(rid, tokens_written, boundaries)  # tree takes its own references
    kv.release_out_of_window(rid, next_pos)   # SWA pages no later query can see
    ...
    kv.extend_draft(rid, start + 1 + k)       # a verified chunk (never worth a preemption)
    ... forward writes K/V of the last token and k drafted ones, j of them are accepted ...
    kv.accept(rid, start + 1 + j)             # pages only rejected tokens were written to go back
    kv.release_out_of_window(rid, start + 1 + j)
    ...
    kv.commit(rid, prompt + output[:-1]); kv.release(rid)   # finish / abort
    kv.commit(...); kv.release(rid, preempted=True)         # preempt (path stamped recent)

Exhausting a pool is a scheduling condition: `extend` returns False and changes nothing the
request holds. Checked transfers raise `KVIntegrityError`; `audit` recounts everything;
`quarantine` takes pages out of circulation and names the requests that must end with an error.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np

from freetoken.errors import ConfigError
from freetoken.kv.audit import AuditReport, holders_of, run_audit
from freetoken.kv.errors import KVIntegrityError
from freetoken.kv.miss import CacheMiss, explain
from freetoken.kv.pins import pin_path, pinned_pages, pinned_swa_pages, release_all
from freetoken.kv.pool import PagePool
from freetoken.kv.snapshots import (
    drop_passing_snapshot,
    end_consumed,
    evict_snapshots,
    fit_snapshots,
    evictable_snapshots,
    plan_snapshot_points,
    request_ends,
    set_ends,
    snapshot_at,
    take_snapshot,
)
from freetoken.kv.table import RequestTables
from freetoken.kv.tree import RadixTree
from freetoken.kv.window import first_window_page, floor_to_page, num_pages

CACHE_TYPES = ("naive", "radix", "swa_radix")
PageTables = tuple[np.ndarray, np.ndarray | None]  # a request's FULL table and its SWA one (None: no SWA pool)
EVICT_BATCH_DIVISOR = 32


def resolve_cache_type(cache_type: str, window: int | None) -> str:
    """`radix` on a model with SWA layers is `swa_radix`; `swa_radix` without them is refused."""
    if cache_type not in CACHE_TYPES:
        raise ConfigError(f"--cache-type must be one of {', '.join(CACHE_TYPES)}, got {cache_type!r}")
    if cache_type == "swa_radix" and window is None:
        raise ConfigError(
            "--cache-type swa_radix needs a model with sliding-window layers and this model has "
            "none; use --cache-type radix (or naive)"
        )
    if cache_type == "radix" and window is not None:
        return "swa_radix"
    return cache_type


class KVManager:
    """Pools + tree + request page tables. All counts are in pages; page 0 is NULL."""

    def __init__(
        self,
        *,
        full_pages: int,
        swa_pages: int | None,
        page_size: int,
        window: int | None,
        cache_type: str,
        max_pinned_pages: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        state_slots: int | None = None,
        snapshot_interval: int = 0,
    ) -> None:
        if page_size < 1:
            raise ConfigError(f"page size must be >= 1, got {page_size}")
        if full_pages < 1:
            raise ConfigError(f"the KV pool needs at least one page, got {full_pages}")
        if window is not None and window < 1:
            raise ConfigError(f"a sliding window must be >= 1 token, got {window}")
        if (window is None) != (swa_pages is None):
            raise ConfigError("an SWA pool is sized exactly when the model has a sliding window")
        if swa_pages is not None and swa_pages < 1:
            raise ConfigError(f"the sliding-window KV pool needs at least one page, got {swa_pages}")
        self.page_size = page_size
        self.window = window
        self.resolved_cache_type = resolve_cache_type(cache_type, window)
        self.full_pool = PagePool("full", full_pages, self._holders)
        self.swa_pool = PagePool("swa", swa_pages, self._holders) if swa_pages else None
        # Hybrid models: one slot per running request (kv/tensors.py holds the states).
        self.state_pool = PagePool("state", state_slots, self._holders) if state_slots else None
        self.tree: RadixTree | None = None
        if self.resolved_cache_type != "naive":
            self.tree = RadixTree(self.full_pool, self.swa_pool, page_size, window, self.state_pool)
            self.tree.clock = clock
        # Hybrid models: a snapshot point at least every this many prompt tokens (0: none).
        self.snapshot_interval = snapshot_interval
        # Copies the states of one slot into another (src, dst): set by whoever allocates the
        # state tensors (engine/build.py); None copies nothing (the pools alone, in unit tests).
        self.copy_state: Callable[[int, int], None] | None = None
        # Retention pins (kv/pins.py): by default at most a quarter of the FULL pool is pinned.
        self.max_pinned_pages = full_pages // 4 if max_pinned_pages is None else max_pinned_pages
        # SWA pages a pin keeps live (the window before each breakpoint): a quarter of that pool.
        self.max_pinned_swa_pages = (swa_pages or 0) // 4
        self.pins_made = 0
        self.pins_refused = 0
        self.pins_released = 0  # times every pin was ended so that a request could be admitted
        self.bytes_per_token: dict[str, int] = {}  # per pool, set by whoever allocates the K/V (status only)
        self._requests: dict[str, RequestTables] = {}
        self._serials = 0  # hybrid models: one per request, naming its ends (kv/snapshots.py)
        self._waiting: dict[str, int] = {}  # hybrid models: a waiting request's serial (`expect`)
        self.audits = 0
        self.violations = 0
        self.last_error: str | None = None

    # -- helpers ----------------------------------------------------------------------------

    def _holders(self, kind: str, page: int) -> tuple[str, ...]:
        return holders_of(kind, page, self.tree, self._requests)

    def _pool(self, kind: str) -> PagePool:
        if kind == "full":
            return self.full_pool
        if kind == "swa" and self.swa_pool is not None:
            return self.swa_pool
        if kind == "state" and self.state_pool is not None:
            return self.state_pool
        raise ValueError(f"no {kind!r} pool (pools: full{', swa' if self.swa_pool else ''})")

    def _req(self, rid: str) -> RequestTables:
        req = self._requests.get(rid)
        if req is None:
            raise KeyError(f"request {rid!r} holds no KV pages (not admitted or released)")
        return req

    @property
    def request_ids(self) -> list[str]:
        return list(self._requests)

    # -- request lifecycle ------------------------------------------------------------------

    def admit(
        self,
        rid: str,
        tokens: Sequence[int],
        *,
        use_cache: bool = True,
        boundaries: Sequence[int] = (),
        prompt_len: int | None = None,
    ) -> int:
        """Admit a request: match its prompt and take its lease; returns the cached length.

        `use_cache=False` (prompt logprobs requested) skips the cache (0). Release the lease at
        once with `release(rid)` if the request then does not fit. On a hybrid model a hit also
        takes the request's own state slot, a copy of the snapshot at the hit (no slot to be
        had: no hit), and the request's snapshot points are planned (`chunk_end`): the marked
        `boundaries`, the resend cap of its `prompt_len` (default: all of `tokens`), where the
        tree's path of it ends and every `snapshot_interval` tokens. A hit on another request's
        end (kv/snapshots.py) ends that request's ends; each commit then names this one's.
        """
        if rid in self._requests:
            raise ValueError(f"request {rid!r} is already admitted")
        req = RequestTables(rid, swa=[] if self.swa_pool is not None else None)
        req.serial = self._waiting.pop(rid, 0) or self._serial()
        if self.tree is not None:
            self.tree.waiting.discard(req.serial)
        if use_cache and self.tree is not None and len(tokens) > 1:
            hit = self.tree.match(tuple(tokens))
            if self.state_pool is not None and hit.length:
                req.state = self._take_state_slot(keep=hit.state)
                if not req.state:
                    self._requests[rid] = req
                    return 0
                if self.copy_state is not None:
                    self.copy_state(hit.state, req.state)
                # The conversation went on from this snapshot: the ends of the request that left
                # it are ends no more; until this one commits further, the hit is its own end.
                end_consumed(self.tree, hit.state)
                set_ends(self.tree, req.serial, [hit.state])
            self.full_pool.incref(hit.full)
            if self.swa_pool is not None and hit.swa is not None:
                self.swa_pool.incref([p for p in hit.swa if p])
                req.swa = list(hit.swa)
            req.full = list(hit.full)
            req.cached_len = req.next_pos = hit.length
        self._requests[rid] = req
        if self.state_pool is not None and self.tree is not None:
            n = len(tokens) if prompt_len is None else prompt_len
            req.cap = floor_to_page(n - 1, self.page_size) if n > 1 else 0
            if use_cache:
                req.stops = plan_snapshot_points(
                    self.tree, tuple(tokens), req.cached_len, boundaries, n, self.snapshot_interval
                )
        return req.cached_len

    def _serial(self) -> int:
        self._serials += 1
        return self._serials

    def expect(self, rid: str, tokens: Sequence[int]) -> None:
        """A request joined the waiting queue (hybrid models): the snapshot it would hit now is
        its end from now on, and the ends of the request that left it are ends no more (the
        conversation went on from there; kv/snapshots.py), so that while it waits that snapshot
        is kept before the other ends. Changes no reference; a no-op on other models."""
        if self.state_pool is None or self.tree is None or rid in self._requests:
            return
        serial = self._waiting[rid] = self._waiting.get(rid) or self._serial()
        self.tree.waiting.add(serial)
        slot = self.tree.peek(tuple(tokens))
        if slot:
            end_consumed(self.tree, slot)
            set_ends(self.tree, serial, [slot])

    def chunk_end(self, rid: str, start: int, end: int) -> int:
        """Where a chunk computing tokens [start, end) should end: before `end` at the first
        snapshot point of the request inside it (hybrid models; else `end`)."""
        for stop in self._req(rid).stops:
            if start < stop < end:
                return stop
        return end

    def _take_state_slot(self, keep: int = 0) -> int:
        """A state slot for a request, evicting snapshots (never `keep`, pinned ones too: a pin
        never starves a request) when none is free; 0 when none can be had."""
        assert self.state_pool is not None
        if self.state_pool.num_free < 1 and self.tree is not None:
            evict_snapshots(self.tree, 1, keep=keep, pinned_too=True)
        got = self.state_pool.alloc(1)
        return got[0] if got else 0

    def explain_miss(self, rid: str, tokens: Sequence[int]) -> CacheMiss | None:
        """Why `rid`'s admission hit stopped where it did; call it right after `admit`, before
        `extend` (which may evict), and only for an admission that used the cache. None without
        a prefix cache."""
        req = self._req(rid)
        if self.tree is None:
            return None
        return explain(self.tree, self.tree.evicted, tokens, req.cached_len, needs_state=self.state_pool is not None)

    def loaded(self, rid: str, length: int) -> None:
        """The K/V of the request's first `length` tokens (whole pages, at least its cached
        length) is now written in its pages by something other than a forward (a disk-tier load
        into pages `extend` gave it): that is its cached length. Pages past `length` go back, as
        do SWA pages no query at `length` or later can see. Commit the loaded tokens next."""
        req = self._req(rid)
        if length < req.cached_len or length % self.page_size:
            raise ValueError(f"request {rid!r}: a load must end on a page at or past its hit, got {length}")
        keep = length // self.page_size
        full, req.full = req.full[keep:], req.full[:keep]
        self.full_pool.decref([p for p in full if p])
        if req.swa is not None and self.swa_pool is not None:
            swa, req.swa = req.swa[keep:], req.swa[:keep]
            self.swa_pool.decref([p for p in swa if p])
        req.cached_len = req.next_pos = length
        self.release_out_of_window(rid, length)

    def pages_needed(self, rid: str, num_tokens: int) -> int:
        """New pages (in each pool) that `extend(rid, num_tokens)` would take."""
        return max(0, num_pages(num_tokens, self.page_size) - len(self._req(rid).full))

    def extend(self, rid: str, num_tokens: int, swa_from: int = 0) -> bool:
        """Grow both tables to cover `num_tokens` tokens, evicting as needed; all-or-nothing.
        New SWA entries below page `swa_from` stay NULL (a disk load fills only the window
        before its end; a forward always extends with 0).

        False (nothing allocated) when even eviction cannot make room: defer or preempt.
        """
        req = self._req(rid)
        need = self.pages_needed(rid, num_tokens)
        if self.state_pool is not None and not req.state:
            if need and not self._make_room(need):
                return False
            req.state = self._take_state_slot()
            if not req.state:
                return False
        if need == 0:
            return True
        first_new = len(req.full)
        nulls = min(need, max(0, swa_from - first_new))
        if not self._make_room(need, need - nulls):
            return False
        full = self.full_pool.alloc(need)
        swa = self.swa_pool.alloc(need - nulls) if self.swa_pool is not None else []
        if full is None or swa is None:  # unreachable after _make_room; give back, stay whole
            self.full_pool.decref(full or [])
            if self.swa_pool is not None:
                self.swa_pool.decref(swa or [])
            return False
        req.full.extend(full)
        if req.swa is not None:
            req.swa.extend([0] * nulls + swa)
        return True

    def extend_draft(self, rid: str, num_tokens: int) -> bool:
        """`extend` for a verified chunk (speculative decoding): the same all-or-nothing growth,
        evicting tree-only pages as needed (the caller never preempts for a draft). Until
        `accept` resolves it the request has a pending draft (audit A6)."""
        req = self._req(rid)
        if not self.extend(rid, num_tokens):
            return False
        req.draft_pending = req.drafted = True
        return True

    def accept(self, rid: str, written: int) -> int:
        """Resolve a verified chunk: K/V is valid for the request's first `written` tokens (the
        accepted ones). Pages past them held only rejected draft tokens and are released like
        any release, from both tables; slots of rejected tokens inside a kept page are rewritten
        before any query reads them (attention masks by position). The tree never sees them:
        commits cover accepted tokens only. Returns the pages released (per table)."""
        req = self._req(rid)
        keep = num_pages(written, self.page_size)
        full, req.full = req.full[keep:], req.full[:keep]
        self.full_pool.decref([p for p in full if p])
        if req.swa is not None and self.swa_pool is not None:
            swa, req.swa = req.swa[keep:], req.swa[:keep]
            self.swa_pool.decref([p for p in swa if p])
        req.draft_pending = False
        return len(full)

    def _make_room(self, need: int, need_swa: int | None = None) -> bool:
        # An eviction pass scans the tree, so when one is needed it frees at least 1/32 of the
        # pool: the scan is paid once per many decode steps, not once per page.
        need_swa = need if need_swa is None else need_swa
        short = need - self.full_pool.num_free
        if short > 0 and self.tree is not None:
            self.tree.evict_full(max(short, self.full_pool.capacity // EVICT_BATCH_DIVISOR))
        if self.swa_pool is not None:
            short_swa = need_swa - self.swa_pool.num_free
            if short_swa > 0 and self.tree is not None:
                self.tree.evict_swa(max(short_swa, self.swa_pool.capacity // EVICT_BATCH_DIVISOR))
            if self.swa_pool.num_free < need_swa:
                return False
        return self.full_pool.num_free >= need

    def state_slot(self, rid: str) -> int:
        """The request's state slot (0: the model has no linear layers)."""
        return self._req(rid).state

    def snapshot_at(self, tokens: Sequence[int], end: int) -> int:
        """The tree's snapshot slot at `end` on the path of `tokens` (0: none, or no state pool):
        read only (the disk tier copies it to host memory)."""
        if self.state_pool is None or self.tree is None:
            return 0
        return snapshot_at(self.tree, tuple(tokens[:end]), end)

    def page_tables(self, rid: str) -> PageTables:
        """int32 [num_pages] FULL table and the SWA table of the same length (0 = NULL)."""
        req = self._req(rid)
        full = np.asarray(req.full, dtype=np.int32)
        swa = None if req.swa is None else np.asarray(req.swa, dtype=np.int32)
        return full, swa

    def commit(
        self, rid: str, tokens: Sequence[int], boundaries: Sequence[int] = (), resend_at: int | None = None
    ) -> None:
        """Let the tree keep the request's written K/V: `tokens` are exactly the tokens whose
        K/V is written (whole pages of them are committed); `boundaries` are positions the
        request marks (a chat request: the end of each message); `resend_at` is where a resend of
        the request's prompt would hit (its length - 1), whose window is kept too. Only adds tree
        references; on a hybrid model, when `len(tokens)` is page-aligned (the request's state is
        at a page boundary), a snapshot of its state there (unless the tree has one): the engine
        also commits a decode step that reaches a page boundary (`_snapshot`)."""
        req = self._req(rid)
        n = floor_to_page(len(tokens), self.page_size)
        if n > len(req.full) * self.page_size:
            raise ValueError(f"request {rid!r} commits {n} tokens but holds pages for fewer")
        if self.tree is None or n == 0:
            return
        committed = tuple(tokens[:n])
        self.tree.insert(committed, req.full, req.swa, boundaries, resend_at)
        req.committed = committed
        if self.state_pool is not None and req.state and len(tokens) == n:
            self._snapshot(req, committed, n)
        if self.state_pool is not None and req.cap:
            set_ends(self.tree, req.serial, request_ends(self.tree, committed, req.cap))

    def _snapshot(self, req: RequestTables, committed: tuple[int, ...], n: int) -> None:
        """Copy-on-commit: the request's state is after token n - 1 now, and only now. A snapshot
        at none of the request's planned points (a chunk that happened to end on a page, a decode
        step's page) is kept only until its next one: the last page boundary its state passed is
        what the next request of a conversation, extending the whole sequence, can hit."""
        assert self.tree is not None
        slot = take_snapshot(self.tree, committed, n)
        if not slot:
            return
        if self.copy_state is not None:
            self.copy_state(req.state, slot)
        pos, old = req.rolling
        if old:
            drop_passing_snapshot(self.tree, committed, pos, old)
        req.rolling = (0, 0) if n in req.stops else (n, slot)

    def release_out_of_window(self, rid: str, next_pos: int) -> int:
        """Drop the request's SWA pages no query at `next_pos` or later can see (q - k >= W).

        Returns the number of entries set to NULL."""
        req = self._req(rid)
        req.next_pos = max(req.next_pos, next_pos)
        if req.swa is None or self.swa_pool is None or self.window is None:
            return 0
        first = min(first_window_page(req.next_pos, self.window, self.page_size), len(req.swa))
        drop = [i for i in range(first) if req.swa[i]]
        pages = [req.swa[i] for i in drop]
        for i in drop:
            req.swa[i] = 0
        self.swa_pool.decref(pages)
        return len(pages)

    def release(self, rid: str, *, preempted: bool = False) -> None:
        """Drop every reference the request holds (finish, abort, preempt, or a lease that did
        not fit; an aborted waiting request holds none). Commit first what is worth keeping. A
        second call is a no-op."""
        serial = self._waiting.pop(rid, None)
        if serial is not None and self.tree is not None:
            self.tree.waiting.discard(serial)
        req = self._requests.pop(rid, None)
        if req is None:
            return
        if preempted and self.tree is not None and req.committed:
            self.tree.touch(req.committed)
        if preempted and self.state_pool is not None and self.tree is not None:
            self._waiting[rid] = req.serial  # back in the queue: its ends are where it resumes
            self.tree.waiting.add(req.serial)
        full, swa, state = req.held("full"), req.held("swa"), req.held("state")
        req.full = []
        req.swa = [] if req.swa is not None else None
        req.state = 0
        self.full_pool.decref(full)
        if self.swa_pool is not None:
            self.swa_pool.decref(swa)
        if self.state_pool is not None:
            self.state_pool.decref(state)

    # -- capacity and eviction --------------------------------------------------------------

    def available(self, kind: str) -> int:
        """Pages of pool `kind` an admission may count on: free pages plus what eviction could
        free now (tree-only pages no request holds, so not those any lease pins)."""
        pool = self._pool(kind)
        if self.tree is None:
            return pool.num_free
        if kind == "state":
            return pool.num_free + evictable_snapshots(self.tree)
        extra = self.tree.evictable_full() if kind == "full" else self.tree.evictable_swa()
        return pool.num_free + extra

    def evict(self, kind: str, num_pages_wanted: int) -> int:
        """Drop tree references until `num_pages_wanted` pages of `kind` are freed (or no more
        can be); returns the pages freed."""
        self._pool(kind)
        if self.tree is None:
            return 0
        if kind == "full":
            return self.tree.evict_full(num_pages_wanted)
        if kind == "state":
            return evict_snapshots(self.tree, num_pages_wanted, pinned_too=True)
        return self.tree.evict_swa(num_pages_wanted)

    # -- retention pins ---------------------------------------------------------------------

    def pin(self, tokens: Sequence[int], end: int, ttl_s: float) -> int:
        """Pin the committed path of `tokens[:end]` (whole pages) for `ttl_s` seconds, renewed on
        each hit; returns the tokens pinned, 0 when refused (past `max_pinned_pages`, counted) or
        when the path is not committed. Changes no reference."""
        if self.tree is None:
            return 0
        pinned = pin_path(self.tree, tokens, end, ttl_s, self.max_pinned_pages, self.max_pinned_swa_pages)
        if pinned is None:
            return 0
        if pinned:
            self.pins_made += 1
        else:
            self.pins_refused += 1
        return pinned

    def release_pins(self) -> bool:
        """End every pin (a pin must never keep a request out); True when there was one."""
        if self.tree is None or not release_all(self.tree):
            return False
        self.pins_released += 1
        return True

    # -- resizing ---------------------------------------------------------------------------

    def capacity(self, kind: str) -> int:
        """Pages of pool `kind` new admissions see (the shrink target while one is in progress)."""
        return self._pool(kind).target

    def held_pages(self, kind: str) -> int:
        """Distinct pages of pool `kind` that requests hold."""
        return len({p for r in self._requests.values() for p in r.held(kind)})

    def resize(self, kind: str, pages: int) -> int:
        """Grow or shrink pool `kind` to `pages` (state: slots); returns the pages still held
        above the new size (0: done). Shrinking first drops the tree's references to every page
        above it (FULL: with the subtree beneath, useless without it; SWA: tombstones), so
        tree-only pages there are freed at once and retire; the state pool instead keeps the
        snapshots that fit below the new size, evicting the others in eviction order, and moves
        them there (`fit_snapshots`). Pages (slots) a request holds retire when it releases them
        (`finish_shrinks` completes it). The caller grows the tensors before a grow and shrinks
        them after `finish_shrinks`. Raises ValueError while a shrink of this pool is in
        progress or below the pages requests hold."""
        pool = self._pool(kind)
        if pool.target != pool.capacity:
            raise ValueError(
                f"the {kind} pool is still shrinking to {pool.target} pages "
                f"({pool.pending_release()} pages above it are held by running requests)"
            )
        if pages > pool.capacity:
            pool.grow(pages - pool.capacity)
            return 0
        held = self.held_pages(kind)
        if pages < held:
            raise ValueError(f"running requests hold {held} pages of the {kind} pool, more than {pages}")
        if pages == pool.capacity:
            return 0
        if kind == "state" and self.tree is not None:
            return fit_snapshots(self.tree, pages, self.copy_state)
        if self.tree is not None:
            above = self.tree.pages_above(kind, pages)
            self.tree.drop(kind, above)
        return pool.shrink(pages)

    def _pools(self) -> list[PagePool]:
        return [p for p in (self.full_pool, self.swa_pool, self.state_pool) if p is not None]

    def finish_shrinks(self) -> list[str]:
        """Complete every shrink whose pages above the target are all released; returns the
        pools whose capacity changed (their tensors can shrink now)."""
        return [pool.kind for pool in self._pools() if pool.finish_shrink()]

    def shrinking(self) -> bool:
        return any(p.target != p.capacity for p in self._pools())

    # -- integrity --------------------------------------------------------------------------

    def audit(self, idle: bool) -> AuditReport:
        """Run A1-A5 (A5 only when `idle`); counts it for `status()`."""
        report = run_audit(
            full_pool=self.full_pool,
            swa_pool=self.swa_pool,
            tree=self.tree,
            requests=self._requests,
            page_size=self.page_size,
            window=self.window,
            idle=idle,
            state_pool=self.state_pool,
        )
        self.audits += 1
        if not report.ok:
            self.violations += 1
            self.last_error = str(report.violations[0])
        return report

    def record_error(self, err: KVIntegrityError) -> None:
        """Count an integrity error the engine caught from a checked transfer."""
        self.violations += 1
        self.last_error = str(err.report)

    def quarantine(self, kind: str, pages: Sequence[int]) -> set[str]:
        """Take pages out of circulation for good: they leave the free list, tree entries on
        them are dropped. Returns the ids of the requests holding any of them (end them with
        an error; their release is safe)."""
        pool = self._pool(kind)
        wanted = {int(p) for p in pages if 0 < int(p) <= pool.capacity}
        pool.quarantine(sorted(wanted))
        if self.tree is not None:
            self.tree.drop(kind, sorted(wanted))
        return {rid for rid, req in self._requests.items() if wanted & set(req.held(kind))}

    def status(self) -> dict[str, object]:
        """The `/v1/cache/status` fields this layer owns (the engine adds `floor`)."""
        pools: dict[str, dict[str, int]] = {}
        quarantined_total = 0
        for pool in (self.full_pool, self.swa_pool, self.state_pool):
            if pool is None:
                continue
            q = set(pool.quarantined_pages())
            held = {p for r in self._requests.values() for p in r.held(pool.kind)} - q
            tree_pages: set[int] = set()
            if self.tree is not None:
                tree_pages = set(self.tree.owned(pool.kind)) - q
            pools[pool.kind] = {
                "capacity": pool.capacity - pool.num_retired,  # converges to `target` while shrinking
                "free": pool.num_free,
                "cached": len(tree_pages - held),
                "in_use": len(held),
                "quarantined": len(q),
                "target": pool.target,
                "pending_release": pool.pending_release(),
            }
            if pool.kind in self.bytes_per_token:
                pools[pool.kind]["bytes_per_token"] = self.bytes_per_token[pool.kind]
            quarantined_total += len(q)
        return {
            "cache_type": self.resolved_cache_type,
            "page_size": self.page_size,
            "pools": pools,
            "pins": {
                "pinned_pages": 0 if self.tree is None else pinned_pages(self.tree),
                "max_pinned_pages": self.max_pinned_pages,
                "pinned_swa_pages": 0 if self.tree is None else pinned_swa_pages(self.tree),
                "made": self.pins_made,
                "refused": self.pins_refused,
                "released": self.pins_released,
            },
            "integrity": {
                "ok": self.violations == 0,
                "audits": self.audits,
                "violations": self.violations,
                "quarantined_pages": quarantined_total,
                "last_error": self.last_error,
            },
        }
