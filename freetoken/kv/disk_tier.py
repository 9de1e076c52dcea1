"""The disk tier under the radix prefix cache: saving committed pages, loading them back.

Owns joining the disk store (kv/disk.py) to the KV manager and the K/V memory (kv/tensors.py,
used through its `page_bytes` / `load_page` / `page_nbytes` and `state_bytes` / `load_state` /
`state_nbytes`; no torch is imported here):

- `save` (write-behind, the engine thread, right after a commit): every committed page not yet
  on disk is copied to host memory and handed to the writer thread: its FULL page, and its SWA
  page where the request holds it live (the window before the commit's end), and on a hybrid
  model the tree's recurrent-state snapshot at the commit's last page boundary, where it has one
  (a `state` file keyed like the page ending there: kv/disk_file.py). The engine saves after
  prompt chunks, at a preemption and at finish, not at a decode step's page boundary: the
  snapshot a finished request's reply leaves (where its conversation's next turn hits) is written
  at its finish, the ones it passed are not. A SIGKILL then
  loses at most the backlog, and a page the tree later evicts is already on disk. When the
  backlog is full the page is dropped and counted; the engine never waits on the disk.
- `load` (synchronous, at admission, right after the in-memory match): the hit is extended past
  the tree by consecutive pages on disk along the prompt's token path, under the same hit rule
  (the cap, and on a sliding-window model the SWA pages of the window before the hit's end), when
  the load policy (kv/disk_cost.py) finds reading them cheaper than prefilling them. The pages
  are allocated to the request (`KVManager.extend`), read and checked (a page's file must hold
  the prompt's own tokens at that position and the expected parent key, and its checksum must
  match: anything else is a miss that ends the hit there), written into the K/V memory, declared
  (`KVManager.loaded`) and committed as usual, so the tree holds them like computed pages. On a
  hybrid model a hit needs the state at exactly its end, so the extension goes only to a
  position with a state file on disk (the hit rule's snapshots); that state is read into the
  request's own state slot (copy-on-hit, as from a tree snapshot), and the commit then gives the
  tree its snapshot there. A state file that fails its checks ends the hit at the previous
  position with one (or at the tree's hit).

Disk entries are not pages (nor state slots): nothing here takes or drops a reference except
through the manager's request API, and the pool audit is unchanged. It does not schedule or decide who runs.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from freetoken.kv.disk import DiskStore
from freetoken.kv.disk_cost import LoadPolicy
from freetoken.kv.disk_file import ROOT, PageHeader, chain_keys
from freetoken.kv.window import first_window_page, floor_to_page, hit_length

if TYPE_CHECKING:
    from freetoken.kv.manager import KVManager
    from freetoken.kv.tensors import KVTensors


@dataclass(frozen=True)
class DiskHit:
    """What the disk tier did at one admission: the hit's length after it, and whether pages on
    disk beyond that were left unloaded (the policy declined, no room, or a file failed)."""

    length: int
    loaded_tokens: int = 0
    left_on_disk: bool = False


@dataclass
class DiskTierCounters:
    hits: int = 0  # admissions whose hit a load extended
    loaded_pages: int = 0  # pages read into the K/V memory (FULL and SWA)
    loaded_states: int = 0  # recurrent-state snapshots read into requests' state slots (hybrid models)
    loaded_tokens: int = 0  # prompt tokens those loads let requests skip
    load_seconds: float = 0.0
    declined: int = 0  # admissions where the policy found recomputing cheaper
    no_room: int = 0  # admissions whose load found no pages to load into
    failed: int = 0  # loads cut short by a file that failed its checks


class DiskTier:
    """The disk store, the load policy and the K/V memory the pages come from and go to."""

    def __init__(
        self, store: DiskStore, tensors: KVTensors, page_size: int, window: int | None, policy: LoadPolicy
    ) -> None:
        self.store = store
        self.tensors = tensors
        self.page_size = page_size
        self.window = window
        self.policy = policy
        self.counters = DiskTierCounters()
        self._nbytes = {
            "full": tensors.page_nbytes(False),
            "swa": tensors.page_nbytes(True) if window else 0,
            "state": tensors.state_nbytes(),  # 0: not a hybrid model
        }
        self.hybrid = self._nbytes["state"] > 0

    def keys(self, tokens: Sequence[int], pages: int | None = None) -> list[bytes]:
        return chain_keys(tokens, self.page_size, self.store.identity, pages)

    # -- write-behind -----------------------------------------------------------------------

    def save(self, kv: KVManager, rid: str, tokens: Sequence[int]) -> int:
        """Queue for the disk every page of `tokens` (as just committed by `rid`) that is not on
        it yet; returns the pages queued."""
        p = self.page_size
        n = floor_to_page(len(tokens), p) // p
        if n == 0:
            return 0
        full, swa = kv.page_tables(rid)
        n = min(n, len(full))
        keys = self.keys(tokens, n)
        queued = 0
        for i, key in enumerate(keys):
            queued += self._save_page("full", key, keys[i - 1] if i else ROOT, i, tokens, int(full[i]))
            if swa is not None and int(swa[i]):
                queued += self._save_page("swa", key, keys[i - 1] if i else ROOT, i, tokens, int(swa[i]))
        if self.hybrid:  # the tree's snapshot at the last page boundary (taken by this commit, or before)
            slot = kv.snapshot_at(tokens, n * p)
            queued += self._save_page("state", keys[-1], keys[-2] if n > 1 else ROOT, n - 1, tokens, slot)
        return queued

    def _save_page(self, kind: str, key: bytes, parent: bytes, i: int, tokens: Sequence[int], page: int) -> int:
        """Queue page `page` of pool `kind` (state: the snapshot in slot `page`) as entry i of the
        path of `tokens`; 1 when queued."""
        if page == 0 or self.store.has(kind, key):
            return 0
        nbytes = self._nbytes[kind]
        if not self.store.room_for(nbytes):  # decided before the copy: a dropped page costs nothing
            self.store.count_dropped()
            return 0
        p = self.page_size
        header = PageHeader(self.store.identity, key, parent, kind, i, p, nbytes)
        if kind == "state":
            payload = self.tensors.state_bytes(page).numpy()
        else:
            payload = self.tensors.page_bytes(kind == "swa", page).numpy()
        return int(self.store.submit(header, tokens[i * p : (i + 1) * p], payload, nbytes))

    # -- loads ------------------------------------------------------------------------------

    def load(self, kv: KVManager, rid: str, tokens: Sequence[int], hit: int, chunk: int = 0) -> DiskHit:
        """Extend `rid`'s admission hit of `hit` tokens from the disk (see the module docstring).
        `chunk`: the tokens the request would compute in its first step; no load is made unless
        the pools can also hold those after it (a request that does not fit would release the
        loaded pages to the tree, whose eviction could drop them before it fits: a load per
        step for nothing)."""
        p = self.page_size
        cap = floor_to_page(len(tokens) - 1, p) if len(tokens) > 1 else 0
        if hit >= cap:
            return DiskHit(hit)
        h = hit // p
        keys = self.keys(tokens, cap // p)
        k = h
        while k < len(keys) and self.store.on_disk("full", keys[k]):
            k += 1
        if k == h:
            return DiskHit(hit)
        live = None if self.window is None else [i < h or self.store.on_disk("swa", keys[i]) for i in range(k)]
        # A hybrid model's hit ends where a state is: past the tree's hit, a state file on disk.
        snaps = [i >= h and self.store.on_disk("state", keys[i]) for i in range(k)] if self.hybrid else None
        target = hit_length(k, live, len(tokens), p, self.window, snaps)
        if target <= hit:
            return DiskHit(hit)
        want = target // p
        first = 0 if self.window is None else first_window_page(target, self.window, p)  # the window before it
        swa_pages = [] if self.window is None else list(range(max(h, first), want))
        nbytes = (want - h) * self._nbytes["full"] + len(swa_pages) * self._nbytes["swa"] + self._nbytes["state"]
        if not self.policy.should_load(nbytes, target - hit):
            self.counters.declined += 1
            return DiskHit(hit, left_on_disk=True)
        if not self._fits(kv, rid, target, min(target + chunk, len(tokens)), first) or not kv.extend(
            rid, target, swa_from=first
        ):
            self.counters.no_room += 1
            return DiskHit(hit, left_on_disk=True)
        start = time.perf_counter()
        full, swa = kv.page_tables(rid)
        ok = h
        while ok < want and self._load_page("full", keys, ok, tokens, int(full[ok])):
            ok += 1
        loaded = set()
        for i in swa_pages:
            if i < ok and swa is not None and self._load_page("swa", keys, i, tokens, int(swa[i])):
                loaded.add(i)
        live_now = None if self.window is None else [i < h or i in loaded for i in range(ok)]
        snaps_now = None if snaps is None else snaps[:ok]
        length = max(hit, hit_length(ok, live_now, len(tokens), p, self.window, snaps_now))
        states = 0
        while self.hybrid and length > hit:  # the state at the hit's end, into the request's own slot
            if self._load_page("state", keys, length // p - 1, tokens, kv.state_slot(rid)):
                states = 1
                break
            snaps_now[length // p - 1] = False  # type: ignore[index]
            length = max(hit, hit_length(ok, live_now, len(tokens), p, self.window, snaps_now))
        kv.loaded(rid, length)
        if length > hit:
            kv.commit(rid, tokens[:length])
        elapsed = time.perf_counter() - start
        read = (ok - h) * self._nbytes["full"] + len(loaded) * self._nbytes["swa"] + states * self._nbytes["state"]
        self.policy.observe_read(read, elapsed)
        c = self.counters
        c.loaded_pages += (ok - h) + len(loaded)
        c.loaded_states += states
        c.load_seconds += elapsed
        if length > hit:
            c.hits += 1
            c.loaded_tokens += length - hit
        if length < target:
            c.failed += 1
        return DiskHit(length, length - hit, left_on_disk=length < target)

    def _fits(self, kv: KVManager, rid: str, target: int, then: int, first: int) -> bool:
        """True when the pools can hold the load (FULL pages to `target`, SWA pages of its window
        from page `first`) and then the request's first chunk (to `then`)."""
        p = self.page_size
        need = kv.pages_needed(rid, then)
        swa = (target // p - max(first, len(kv.page_tables(rid)[0]))) + (need - kv.pages_needed(rid, target))
        return kv.available("full") >= need and (self.window is None or kv.available("swa") >= swa)

    def _load_page(self, kind: str, keys: list[bytes], i: int, tokens: Sequence[int], page: int) -> bool:
        """Read page i of the prompt's path from disk into `page` (state: the state after it into
        slot `page`); False (a miss) when the file is gone or is not exactly that page."""
        got = self.store.read(kind, keys[i])
        if got is None:
            return False
        header, page_tokens, payload = got
        p = self.page_size
        parent = keys[i - 1] if i else ROOT
        if (
            header.index != i
            or header.page_size != p
            or header.parent != parent
            or header.payload_len != self._nbytes[kind]
            or page_tokens != list(tokens[i * p : (i + 1) * p])
        ):
            self.store.drop(kind, keys[i])
            return False
        if kind == "state":
            self.tensors.load_state(page, payload)
        else:
            self.tensors.load_page(kind == "swa", page, payload)
        return True

    # -- reporting --------------------------------------------------------------------------

    def status(self) -> dict[str, object]:
        """The `disk` section of `/v1/cache/status`."""
        c = self.counters
        return {
            **self.store.status(),
            "hits": c.hits,
            "loaded_pages": c.loaded_pages,
            "loaded_states": c.loaded_states,
            "loaded_tokens": c.loaded_tokens,
            "load_seconds": round(c.load_seconds, 6),
            "declined": c.declined,
            "no_room": c.no_room,
            "failed_loads": c.failed,
            **self.policy.status(),
        }

    def close(self, timeout_s: float | None = None) -> bool:
        """Write the backlog (up to `timeout_s`) and stop the writer."""
        return self.store.close(timeout_s)
