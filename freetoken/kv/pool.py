"""One pool of KV pages and its reference counts.

Owns the reference count of every page of one pool (FULL or SWA), the free list and the set of
quarantined pages. It does not know who the holders are (the manager passes a callback that
names them for error reports) and never decides what to free: a page becomes free only through
`decref` taking its count from 1 to 0 (DESIGN.md §3, rules 1 and 2).

Invariants kept here, each checked on every call and reported as `KVIntegrityError`:
- page 0 is the NULL sentinel: never allocated, increfed, decrefed or freed;
- `alloc` hands out only pages that are free (rc == 0, on the free list);
- `incref`/`decref` require rc > 0; a 1 -> 0 transition requires the page not already free;
- bulk operations require unique page indices (checked before anything changes);
- the free list holds each free page once and never a quarantined page.
Running out is not an error: `alloc` returns None and changes nothing.

Resizing (`grow`, `shrink`, `finish_shrink`): growing appends free pages; shrinking to a target
takes the free pages above it off the free list at once (new allocations see the new size) and
*retires* each page above it when its last holder releases it (decref 1 -> 0), so a page above
the target is never handed out again; once none is held, `finish_shrink` drops them. Retired
pages, like quarantined ones, are neither free nor held.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from freetoken.kv.errors import IntegrityReport, KVIntegrityError

NULL_PAGE = 0

HoldersFn = Callable[[str, int], tuple[str, ...]]


class PagePool:
    """Reference-counted pages 1..capacity of one pool ("full" or "swa")."""

    def __init__(self, kind: str, capacity: int, holders: HoldersFn | None = None) -> None:
        if capacity < 1:
            raise ValueError(f"a {kind} pool needs at least one page, got {capacity}")
        self.kind = kind
        self.capacity = capacity
        self.rc = np.zeros(capacity + 1, dtype=np.int64)  # [capacity + 1], index 0 = NULL
        self._is_free = np.zeros(capacity + 1, dtype=bool)
        self._quarantined = np.zeros(capacity + 1, dtype=bool)
        self._retired = np.zeros(capacity + 1, dtype=bool)  # above the shrink target, released
        self._target = capacity  # pages 1..target may be handed out; < capacity while shrinking
        # Stack: alloc pops from the end. Reversed so that page 1 goes out first.
        self._free: list[int] = list(range(capacity, 0, -1))
        self._is_free[1:] = True
        self._holders = holders

    # -- reporting --------------------------------------------------------------------------

    def set_holders(self, holders: HoldersFn) -> None:
        """Name the callback that lists a page's holders in error reports."""
        self._holders = holders

    def integrity_error(self, check: str, page: int, message: str) -> KVIntegrityError:
        """An error about `page` of this pool, naming its count and holders (not raised here)."""
        holders = self._holders(self.kind, page) if self._holders is not None else ()
        rc = int(self.rc[page]) if 0 <= page < len(self.rc) else -1
        return KVIntegrityError(IntegrityReport(check, self.kind, page, rc, holders, message))

    def _checked_indices(self, check: str, pages: Sequence[int]) -> np.ndarray:
        idx = np.asarray(pages, dtype=np.int64).reshape(-1)
        if idx.size == 0:
            return idx
        bad = idx[(idx < 1) | (idx > self.capacity)]
        if bad.size:
            raise self.integrity_error(check, int(bad[0]), "page index is NULL or out of range")
        if idx.size > 1:
            uniq, counts = np.unique(idx, return_counts=True)
            if uniq.size != idx.size:
                page = int(uniq[counts > 1][0])
                raise self.integrity_error("unique", page, f"bulk {check} names the page twice")
        return idx

    # -- queries ----------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        """Length of the free list."""
        return len(self._free)

    def free_pages(self) -> list[int]:
        """A copy of the free list (for the audit)."""
        return list(self._free)

    def is_quarantined(self, page: int) -> bool:
        return bool(self._quarantined[page])

    def quarantined_pages(self) -> list[int]:
        return [int(p) for p in np.flatnonzero(self._quarantined)]

    @property
    def num_quarantined(self) -> int:
        return int(self._quarantined.sum())

    @property
    def target(self) -> int:
        """The capacity new allocations see (== capacity unless a shrink is in progress)."""
        return self._target

    @property
    def num_retired(self) -> int:
        return int(self._retired.sum())

    def retired_pages(self) -> list[int]:
        return [int(p) for p in np.flatnonzero(self._retired)]

    def usable(self, page: int) -> bool:
        """False for a quarantined page and for a page above a shrink target: no new holder
        (the tree) may take it."""
        return page <= self._target and not self._quarantined[page]

    def pending_release(self) -> int:
        """Pages above the shrink target that a holder still holds."""
        above = slice(self._target + 1, self.capacity + 1)
        return int((~self._retired[above] & ~self._quarantined[above]).sum())

    # -- transfers --------------------------------------------------------------------------

    def alloc(self, n: int) -> list[int] | None:
        """Take n free pages, each with rc 1 held by the caller; None (nothing taken) if short."""
        if n < 0:
            raise ValueError(f"alloc of {n} pages")
        if n == 0:
            return []
        if n > len(self._free):
            return None
        pages = self._free[-n:]
        idx = self._checked_indices("alloc", pages)
        for p in pages:
            if self.rc[p] != 0 or not self._is_free[p] or self._quarantined[p]:
                raise self.integrity_error("alloc", p, "free list holds a page that is not free")
        del self._free[-n:]
        self._is_free[idx] = False
        self.rc[idx] = 1
        return pages

    def incref(self, pages: Sequence[int]) -> None:
        """Add one reference to each page; every page must already be held (rc > 0)."""
        idx = self._checked_indices("incref", pages)
        if idx.size == 0:
            return
        dead = idx[self.rc[idx] <= 0]
        if dead.size:
            raise self.integrity_error("incref", int(dead[0]), "incref of a page nobody holds")
        self.rc[idx] += 1

    def decref(self, pages: Sequence[int]) -> int:
        """Drop one reference from each page; returns how many pages became free.

        A quarantined page may carry a count that no longer means anything: its decref never
        raises and never frees it.
        """
        idx = self._checked_indices("decref", pages)
        if idx.size == 0:
            return 0
        q = self._quarantined[idx]
        live = idx[~q]
        dead = live[self.rc[live] <= 0]
        if dead.size:
            raise self.integrity_error("decref", int(dead[0]), "decref of a page nobody holds")
        zero = live[self.rc[live] == 1]
        already = zero[self._is_free[zero]]
        if already.size:
            raise self.integrity_error("decref", int(already[0]), "page is already on the free list")
        self.rc[live] -= 1
        qi = idx[q]
        self.rc[qi] = np.maximum(self.rc[qi] - 1, 0)
        back = zero[zero <= self._target]
        self._retired[zero[zero > self._target]] = True
        self._is_free[back] = True
        self._free.extend(int(p) for p in back)
        return int(zero.size)

    def quarantine(self, pages: Sequence[int]) -> list[int]:
        """Take pages out of circulation for good; returns the ones newly quarantined."""
        new = sorted({int(p) for p in pages if 1 <= int(p) <= self.capacity})
        new = [p for p in new if not self._quarantined[p]]
        if not new:
            return []
        self._quarantined[new] = True
        if self._is_free[new].any():
            gone = set(p for p in new if self._is_free[p])
            self._free = [p for p in self._free if p not in gone]
            self._is_free[list(gone)] = False
        return new

    # -- resizing ---------------------------------------------------------------------------

    def grow(self, n: int) -> None:
        """Add n free pages (capacity + 1 .. capacity + n); not while a shrink is in progress."""
        if n < 1 or self._target != self.capacity:
            raise ValueError(f"grow by {n} pages of a pool at {self._target}/{self.capacity}")
        old = self.capacity
        new = old + n
        self.rc = np.concatenate([self.rc, np.zeros(n, dtype=np.int64)])
        for name in ("_is_free", "_quarantined", "_retired"):
            setattr(self, name, np.concatenate([getattr(self, name), np.zeros(n, dtype=bool)]))
        self._is_free[old + 1 :] = True
        self._free[:0] = range(new, old, -1)  # below the stack's top: pages in use stay compact
        self.capacity = self._target = new

    def shrink(self, target: int) -> int:
        """Hand out no page above `target` from now on: free ones leave the free list at once,
        held ones retire when released. Returns the pages still held above it."""
        if not 1 <= target <= self.capacity:
            raise ValueError(f"shrink of a {self.capacity}-page pool to {target}")
        self._target = target
        gone = [p for p in self._free if p > target]
        if gone:
            self._free = [p for p in self._free if p <= target]
            self._is_free[gone] = False
            self._retired[gone] = True
        return self.pending_release()

    def finish_shrink(self) -> bool:
        """Drop the pages above the target once none is held; True when the capacity changed."""
        if self._target == self.capacity or self.pending_release():
            return False
        n = self._target + 1
        self.rc = self.rc[:n].copy()
        for name in ("_is_free", "_quarantined", "_retired"):
            setattr(self, name, getattr(self, name)[:n].copy())
        self.capacity = self._target
        return True
