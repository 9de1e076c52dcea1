"""The content oracle of the KV tests: a shadow of what every page slot holds.

The audit (A1-A5) counts references; it cannot see a hit, a heal or a release that points at
the wrong page, because a wrong page is counted exactly like the right one. The shadow model
records, for every page slot the forward writes, *which token prefix* its K/V was computed
from (an exact interned id of tokens[:pos + 1]: K/V at position pos depends on the whole
prefix). Then, after every KV manager call:

- every tree entry must hold, in each slot of its FULL page and of its live SWA page, the K/V of
  its own path (the node keys from the root) at that position;
- every request entry must hold, for each position it claims (cached at admission or written
  since), the K/V of the request's own tokens; an SWA entry it holds must too;
- and at every forward, before the model would read them, every key the chunk's queries see
  (all earlier positions for FULL layers, the last W - 1 and the query itself for SWA layers)
  must sit in a non-NULL page of the request's tables holding exactly that prefix.

`CheckedKV` is a `KVManager` that runs the shadow check and the full audit after every public
call, and records the events the tests report (tombstone hits, heals, preemptions, evictions
under a held path, the seed step). Nothing here changes what the manager does.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from freetoken.kv.audit import run_audit
from freetoken.kv.manager import KVManager
from freetoken.kv.tree import Node


class ShadowViolation(AssertionError):
    """A holder points at K/V of other tokens than it claims, or the audit failed."""


class PrefixIds:
    """Exact ids of token prefixes: the id of tokens[:i + 1] is interned from (id of
    tokens[:i], tokens[i]), so two sequences get the same id at i iff their prefixes agree."""

    def __init__(self) -> None:
        self._ids: dict[tuple[int, int], int] = {}

    def chain(self, parent: int, tokens: Sequence[int]) -> list[int]:
        out: list[int] = []
        for tok in tokens:
            key = (parent, int(tok))
            parent = self._ids.get(key, 0)
            if parent == 0:
                parent = self._ids[key] = len(self._ids) + 1
            out.append(parent)
        return out


@dataclass
class _ReqShadow:
    tokens: list[int]  # what the request's K/V is computed from, as far as known
    valid: int  # positions [0, valid) hold its K/V (cached at admission or written since)
    ids: list[int] = field(default_factory=list)


class Shadow:
    """What each page slot holds (a prefix id, None = never written) and what each request
    claims. Page contents persist across free and re-allocation, as real memory does."""

    def __init__(self, page_size: int, window: int | None) -> None:
        self.page_size = page_size
        self.window = window
        self.ids = PrefixIds()
        self.content: dict[str, dict[int, list[int | None]]] = {"full": {}, "swa": {}}
        self.requests: dict[str, _ReqShadow] = {}
        # Hybrid models: the prefix id whose recurrent state each state slot holds (0: the zero
        # state of the empty prefix; absent: never written).
        self.state: dict[int, int | None] = {}
        self.writes = 0
        self.enabled = True  # False: record writes, check nothing (to show what the audit misses)

    # -- what the engine does -----------------------------------------------------------------

    def admit(self, rid: str, tokens: Sequence[int], cached: int) -> None:
        self.requests[rid] = _ReqShadow(list(tokens), cached)

    def release(self, rid: str) -> None:
        self.requests.pop(rid, None)

    def _ids_of(self, req: _ReqShadow, upto: int) -> list[int]:
        if len(req.ids) < upto:
            parent = req.ids[-1] if req.ids else 0
            req.ids.extend(self.ids.chain(parent, req.tokens[len(req.ids) : upto]))
        return req.ids

    def copy_state(self, src: int, dst: int) -> None:
        """The KV manager's state copy (a snapshot taken, a hit's copy)."""
        self.state[dst] = self.state.get(src)

    def write(self, rid: str, tokens: Sequence[int], start: int, n: int,
              full: Sequence[int], swa: Sequence[int] | None, state_slot: int = 0) -> None:
        """The forward computes tokens[start:start + n] of `rid` into its tables: check every key
        its queries will read, then record the writes. `tokens` covers at least start + n. On a
        hybrid model the chunk starts from the state in `state_slot` (zeroed at position 0),
        which must be the state of its own prefix tokens[:start], and leaves the state of
        tokens[:start + n] there."""
        req = self.requests.get(rid)
        if req is None:
            raise ShadowViolation(f"forward of {rid}, which holds no KV pages")
        if len(tokens) > len(req.tokens):
            if list(tokens[: len(req.tokens)]) != req.tokens[: len(tokens)]:
                raise ShadowViolation(f"{rid}'s tokens changed under its K/V")
            req.tokens = list(tokens)
        if start > req.valid:
            raise ShadowViolation(
                f"{rid} computes from {start} but only [0, {req.valid}) of its K/V exists")
        p = self.page_size
        ids = self._ids_of(req, start + n)
        for kind, table in (("full", full), ("swa", swa)):
            if table is None:
                continue
            stores: list[tuple[int, int, int]] = []  # (page, slot, prefix id)
            for pos in range(start, start + n):
                page = int(table[pos // p]) if pos // p < len(table) else 0
                if page == 0:
                    raise ShadowViolation(f"{rid} writes position {pos} into a NULL {kind} entry")
                stores.append((page, pos % p, ids[pos]))
            self._store(kind, stores)
        self.writes += 1
        if state_slot:
            have = 0 if start == 0 else self.state.get(state_slot)
            if self.enabled and have != (ids[start - 1] if start else 0):
                raise ShadowViolation(
                    f"{rid} computes from {start} starting from state slot {state_slot} holding "
                    f"the state of prefix {have}, not of its own (id {ids[start - 1]})")
            self.state[state_slot] = ids[start + n - 1]
        req.valid = max(req.valid, start + n)
        end = start + n
        if not self.enabled:
            return
        self._check_read(rid, "full", full, 0, end, ids)
        if swa is not None and self.window is not None:
            self._check_read(rid, "swa", swa, max(0, start - self.window + 1), end, ids)

    # -- where the content lives (a subclass keeps it in real K/V tensors) ----------------------

    def _store(self, kind: str, stores: list[tuple[int, int, int]]) -> None:
        """Record that slot `slot` of page `page` now holds the K/V of prefix `pid`."""
        for page, slot, pid in stores:
            self.content[kind].setdefault(page, [None] * self.page_size)[slot] = pid

    def _slots(self, kind: str, page: int) -> list[int | None]:
        """The prefix id each slot of `page` holds (None: never written)."""
        return self.content[kind].get(page, [None] * self.page_size)

    def _check_read(self, rid: str, kind: str, table: Sequence[int], lo: int, hi: int,
                    ids: list[int]) -> None:
        p = self.page_size
        for k in range(lo, hi):
            page = int(table[k // p]) if k // p < len(table) else 0
            got = self._slots(kind, page)[k % p] if page else None
            if page == 0 or got != ids[k]:
                where = "NULL" if page == 0 else f"page {page} slot {k % p} holds {got}"
                raise ShadowViolation(
                    f"{rid}'s forward reads key {k} from its {kind} table ({where}), "
                    f"not the K/V of its own prefix (id {ids[k]})")

    # -- the check after every call -----------------------------------------------------------

    def problems(self, kv: KVManager, limit: int = 8) -> list[str]:
        """Every holder whose pages do not hold the tokens it claims (at most `limit`)."""
        out: list[str] = []
        p = self.page_size
        if not self.enabled:
            return out
        if kv.tree is not None:
            end_id: dict[int, int] = {id(kv.tree.root): 0}
            for node in kv.tree.nodes():
                ids = self.ids.chain(end_id[id(node.parent)], node.key)
                end_id[id(node)] = ids[-1] if ids else end_id[id(node.parent)]
                for j in range(node.npages):
                    for kind, page in (("full", node.full[j]), ("swa", node.swa[j])):
                        if page:
                            self._claim(out, f"tree node#{node.uid} entry {j}", kind, page,
                                        node.start + j * p, ids[j * p : (j + 1) * p])
                    slot = node.state[j] if node.state else 0
                    if slot and self.state.get(slot) != ids[(j + 1) * p - 1]:
                        out.append(f"tree node#{node.uid} entry {j}: snapshot slot {slot} holds the state "
                                   f"of prefix {self.state.get(slot)}, claims {ids[(j + 1) * p - 1]}")
                if len(out) >= limit:
                    return out
        for rid, tables in kv._requests.items():
            req = self.requests.get(rid)
            if req is None:
                out.append(f"request {rid} holds pages the shadow never saw admitted")
                continue
            ids = self._ids_of(req, req.valid)
            if tables.state and req.valid and self.state.get(tables.state) != ids[req.valid - 1]:
                out.append(f"request {rid}: state slot {tables.state} holds the state of prefix "
                           f"{self.state.get(tables.state)}, not of its {req.valid} tokens")
            for kind, table in (("full", tables.full), ("swa", tables.swa or [])):
                for i, page in enumerate(table):
                    lo, hi = i * p, min((i + 1) * p, req.valid)
                    if page and lo < hi:
                        self._claim(out, f"request {rid} {kind}[{i}]", kind, page, lo, ids[lo:hi])
            if len(out) >= limit:
                break
        return out

    def _claim(self, out: list[str], who: str, kind: str, page: int, pos: int,
               want: list[int]) -> None:
        have = self._slots(kind, page)
        if have[: len(want)] != want:
            out.append(f"{who}: {kind} page {page} for positions [{pos}, {pos + len(want)}) "
                       f"holds {have[: len(want)]}, claims {want}")


def path_entries(kv: KVManager, tokens: Sequence[int]) -> list[tuple[Node, int]]:
    """The tree entries (node, index) of the existing whole-page prefix of `tokens`."""
    assert kv.tree is not None
    return kv.tree._walk(tuple(tokens), len(tokens) // kv.page_size)


class CheckedKV(KVManager):
    """A KVManager whose every public call is followed by the shadow check and the full audit
    (A5 when no request holds pages). It records events in `counts` and a per-step `log`."""

    audit_each_call = True

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.shadow = Shadow(self.page_size, self.window)
        self.counts: Counter[str] = Counter()
        self.log: list[tuple[str, str]] = []  # (op, rid) of the current step
        self.checks = 0
        self.prompt_len: dict[str, int] = {}
        self.seeded: dict[str, tuple[str, int]] = {}  # B -> (holder A, decodes since the commit)
        # Pages the (null) runner's K/V tensors hold per pool: a table entry past them would
        # index memory that does not exist.
        self.tensor_pages = {"full": self.full_pool.capacity, "swa": self.swa_pool.capacity if self.swa_pool else 0,
                             "state": self.state_pool.capacity if self.state_pool else 0}
        if self.state_pool is not None:
            self.copy_state = self._copy_state
        if self.tree is not None:
            for kind in ("full", "swa"):
                name = f"evict_{kind}"
                setattr(self.tree, name, self._watched_evict(kind, getattr(self.tree, name)))

    # -- the check ------------------------------------------------------------------------

    def verify(self, after: str) -> None:
        self.checks += 1
        problems = self.shadow.problems(self)
        if not self.audit_each_call:
            if problems:
                raise ShadowViolation(f"after {after}:\n  " + "\n  ".join(problems))
            return
        report = run_audit(full_pool=self.full_pool, swa_pool=self.swa_pool, tree=self.tree,
                           requests=self._requests, page_size=self.page_size,
                           window=self.window, idle=not self._requests, state_pool=self.state_pool)
        problems += [str(v) for v in report.violations]
        if problems:
            raise ShadowViolation(f"after {after}:\n  " + "\n  ".join(problems))

    # -- the calls ------------------------------------------------------------------------

    def admit(self, rid: str, tokens: Sequence[int], *, use_cache: bool = True, boundaries: Sequence[int] = (),
              prompt_len: int | None = None) -> int:
        cached = super().admit(rid, tokens, use_cache=use_cache, boundaries=boundaries, prompt_len=prompt_len)
        self.shadow.admit(rid, tokens, cached)
        self.prompt_len[rid] = len(tokens)
        self.log.append(("admit", rid))
        if not use_cache:
            self.counts["admission without cache (prompt logprobs)"] += 1
        if cached:
            self.counts["hit"] += 1
            if self.swa_pool is not None:
                entries = path_entries(self, tokens[:cached])
                if any(n.swa[j] == 0 for n, j in entries):
                    self.counts["hit through a tombstone"] += 1
        self.verify(f"admit({rid}) -> {cached}")
        return cached

    def extend(self, rid: str, num_tokens: int) -> bool:
        ok = super().extend(rid, num_tokens)
        if not ok:
            self.counts["extend refused (pool short)"] += 1
        self.verify(f"extend({rid}, {num_tokens}) -> {ok}")
        return ok

    def commit(
        self, rid: str, tokens: Sequence[int], boundaries: Sequence[int] = (), resend_at: int | None = None
    ) -> None:
        tomb: set[int] = set()
        beneath_held = False
        before = self.tree.num_pages("full") if self.tree is not None else 0
        if self.tree is not None and self.swa_pool is not None:
            req = self._requests[rid]
            others = {p for r, t in self._requests.items() if r != rid for p in t.full}
            for node, j in path_entries(self, tokens):
                if node.swa[j] == 0:
                    tomb.add(node.full[j])
                    if node.full[j] in others and node.full[j] not in req.full:
                        beneath_held = True
        super().commit(rid, tokens, boundaries, resend_at)
        self.log.append(("commit beneath held" if beneath_held else "commit", rid))
        if self.tree is not None:
            healed = sum(1 for n in self.tree.nodes() for f, s in zip(n.full, n.swa)
                         if s and f in tomb)
            if healed:
                self.counts["heal"] += 1
            if beneath_held and self.tree.num_pages("full") > before:
                self.counts["commit beneath a tombstone another request holds"] += 1
                holder = next(r for r, t in self._requests.items() if r != rid
                              and tomb & set(t.full))
                if self._requests[rid].cached_len == 0:
                    self.seeded.setdefault(rid, (holder, 0))
        self.verify(f"commit({rid}, {len(tokens)} tokens)")

    def release_out_of_window(self, rid: str, next_pos: int) -> int:
        n = super().release_out_of_window(rid, next_pos)
        if n:
            self.counts["out-of-window release"] += 1
        self.verify(f"release_out_of_window({rid}, {next_pos})")
        return n

    def release(self, rid: str, *, preempted: bool = False) -> None:
        if rid in self._requests:
            self.log.append(("release", rid))
            if preempted:
                self.counts["preemption"] += 1
            seed = self.seeded.pop(rid, None)
            if seed is not None and seed[1] >= 2 and seed[0] in self._requests and not preempted:
                self.counts["seed: B commits beneath a tombstone A holds, decodes 2+ beside A, ends"] += 1
        super().release(rid, preempted=preempted)
        self.shadow.release(rid)
        self.verify(f"release({rid}, preempted={preempted})")

    def evict(self, kind: str, num_pages_wanted: int) -> int:
        freed = super().evict(kind, num_pages_wanted)
        self.verify(f"evict({kind}, {num_pages_wanted}) -> {freed}")
        return freed

    def pin(self, tokens: Sequence[int], end: int, ttl_s: float) -> int:
        pinned = super().pin(tokens, end, ttl_s)
        self.counts["pin" if pinned else "pin refused or not committed"] += 1
        self.verify(f"pin({len(tokens)} tokens, end {end}) -> {pinned}")
        return pinned

    def resize(self, kind: str, pages: int) -> int:
        before = self._pool(kind).capacity
        pending = super().resize(kind, pages)
        self.counts[f"{kind} {'grow' if pages > before else 'shrink'}"] += 1
        if pending:
            self.counts["shrink waits for running requests"] += 1
        self.verify(f"resize({kind}, {pages}) -> {pending} pending")
        return pending

    def finish_shrinks(self) -> list[str]:
        done = super().finish_shrinks()
        if done:
            self.counts["shrink completed after requests released"] += 1
        self.verify(f"finish_shrinks() -> {done}")
        return done

    def quarantine(self, kind: str, pages: Sequence[int]) -> set[str]:
        holders = super().quarantine(kind, pages)
        self.verify(f"quarantine({kind}, {list(pages)})")
        return holders

    # -- what the runner reports ----------------------------------------------------------

    def _copy_state(self, src: int, dst: int) -> None:
        """The state copy the tensors would do: both slots must exist in them."""
        if not (0 < src <= self.tensor_pages["state"] and 0 < dst <= self.tensor_pages["state"]) or src == dst:
            raise ShadowViolation(f"state copy {src} -> {dst} past the {self.tensor_pages['state']} slots the tensors hold")
        self.shadow.copy_state(src, dst)

    def resized_tensors(self, kind: str, pages: int) -> None:
        """The runner reallocated a pool's tensors: a state slot past them lost its state."""
        self.tensor_pages[kind] = pages
        if kind == "state":
            for slot in [s for s in self.shadow.state if s > pages]:
                del self.shadow.state[slot]

    def forward(self, rid: str, tokens: Sequence[int], start: int, n: int, state_slot: int = 0) -> None:
        """The forward of one item: shadow writes and read checks (and its state, hybrid models)."""
        full, swa = self.page_tables(rid)
        if state_slot > self.tensor_pages["state"]:
            raise ShadowViolation(f"{rid}'s state slot {state_slot} is past the {self.tensor_pages['state']} slots "
                                  f"the tensors hold")
        for kind, table in (("full", full), ("swa", swa)):
            if table is not None and len(table) and int(table.max()) > self.tensor_pages[kind]:
                raise ShadowViolation(f"{rid}'s {kind} table names page {int(table.max())}, past the "
                                      f"{self.tensor_pages[kind]} pages the K/V tensors hold")
        self.shadow.write(rid, tokens, start, n, full, swa, state_slot)
        self.log.append(("forward", rid))
        if rid in self.seeded and start >= self.prompt_len.get(rid, 0) and n == 1:
            holder, decodes = self.seeded[rid]
            self.seeded[rid] = (holder, decodes + (holder in self._requests))

    def end_step(self) -> None:
        """Called between engine steps: records same-step orderings, then clears the log."""
        admitted = {r for op, r in self.log if op == "admit"}
        commits = [(op, r) for op, r in self.log if op.startswith("commit")]
        for i, (_, a) in enumerate(commits):
            later = [(op, b) for op, b in commits[i + 1 :] if b in admitted and b != a]
            if a not in admitted and later:
                self.counts["same step: B matched, A commits, B commits"] += 1
                if any(op == "commit beneath held" for op, _ in later):
                    self.counts["same step: ... B commits beneath a held tombstone"] += 1
                break
        self.log.clear()

    # -- eviction watch -------------------------------------------------------------------

    def _watched_evict(self, kind: str, evict):  # type: ignore[no-untyped-def]
        def watched(need: int) -> int:
            tree = self.tree
            assert tree is not None
            held = {p for t in self._requests.values() for p in t.full}
            under_held: dict[int, bool] = {}  # full page -> it or an ancestor is request-held
            flag: dict[int, bool] = {id(tree.root): False}
            for node in tree.nodes():
                above = flag[id(node.parent)]
                for f in node.full:
                    above = above or f in held
                    under_held[f] = above
                flag[id(node)] = above
            live_before = {f for n in tree.nodes() for f, s in zip(n.full, n.swa) if s}
            freed = evict(need)
            if freed:
                self.counts[f"{kind} eviction"] += 1
                if kind == "full":
                    gone = [f for f in under_held if f not in tree._full_at]
                else:
                    live_after = {f for n in tree.nodes() for f, s in zip(n.full, n.swa) if s}
                    gone = [f for f in live_before - live_after]
                if any(under_held.get(f, False) for f in gone):
                    self.counts[f"{kind} eviction under a request-held path"] += 1
            return freed

        return watched
