"""The KV audit: recount every reference from scratch and compare (A1-A5 of DESIGN.md §3).

Owns the checks and their report. It reads the pools, the tree and the request tables and
changes nothing; quarantined pages are left out of A1, A2 and A5. A failure names the page, its
reference count and every holder, so the report alone says where a page went.

- A1 rc == tree references + request references, per pool, per page;
- A2 the free list is exactly {p >= 1 : rc[p] == 0}, no duplicates, NULL never in it;
- A3 tree structure: no page in two tree entries, no NULL full entry, page-aligned nodes, no
  empty node, no snapshot slot a request also holds, no recorded end (kv/snapshots.py) on a slot
  the tree does not hold;
- A4 each running request: no hole in its FULL table, in-window SWA entries live, SWA entries
  out of the window NULL;
- A5 at idle: free + tree pages == capacity (less quarantined and retired pages) per pool;
- A6 speculative decoding, "draft k, accept j": between steps no verified chunk is unresolved,
  and a request that drafted holds no page past its written tokens (`next_pos`): the pages its
  k - j rejected tokens alone were written to went back through a release.

Retired pages (released above a shrink target, kv/pool.py) are left out like quarantined ones,
and A3 also checks that the tree holds none of them.

The state pool of a hybrid model (the conv and recurrent states of its linear-attention layers,
one slot per running request and one per snapshot the tree keeps) is recounted like a page pool
under A1, A2, A3 and A5; its holders are the requests' `state` entries and the tree entries
holding a snapshot.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from freetoken.kv.errors import IntegrityReport, KVIntegrityError
from freetoken.kv.pool import PagePool
from freetoken.kv.table import RequestTables
from freetoken.kv.tree import Node, RadixTree
from freetoken.kv.window import first_window_page, num_pages

MAX_REPORTS_PER_CHECK = 20


@dataclass
class AuditReport:
    """Result of one audit: empty `violations` means clean."""

    violations: list[IntegrityReport] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.violations

    def checks_failed(self) -> set[str]:
        return {v.check for v in self.violations}

    def raise_if_failed(self) -> None:
        if self.violations:
            raise KVIntegrityError(self.violations)

    def __str__(self) -> str:
        return "audit clean" if self.ok else "\n".join(str(v) for v in self.violations)


def holders_of(kind: str, page: int, tree: RadixTree | None, requests: Mapping[str, RequestTables]) -> tuple[str, ...]:
    """Every holder of `page` in pool `kind`: tree entries (by scan) and request entries."""
    out: list[str] = []
    if tree is not None:
        for node in tree.nodes():
            entries = _entries(node, kind)
            what = " snapshot" if kind == "state" else ""
            out.extend(
                f"tree node#{node.uid} [{node.start},{node.end}) entry {j}{what}"
                for j, p in enumerate(entries)
                if p == page
            )
    if kind == "state":
        return (*out, *(f"request {rid} state" for rid, req in requests.items() if req.state == page))
    for rid, req in requests.items():
        table = req.full if kind == "full" else (req.swa or [])
        out.extend(f"request {rid} {kind}[{i}]" for i, p in enumerate(table) if p == page)
    return tuple(out)


def _entries(node: Node, kind: str) -> list[int]:
    return node.full if kind == "full" else node.swa if kind == "swa" else node.state


def _tree_refs(kind: str, tree: RadixTree | None) -> Counter[int]:
    refs: Counter[int] = Counter()
    if tree is not None:
        for node in tree.nodes():
            refs.update(p for p in _entries(node, kind) if p)
    return refs


def _audit_pool(
    pool: PagePool, tree: RadixTree | None, requests: Mapping[str, RequestTables], idle: bool, report: AuditReport
) -> None:
    kind = pool.kind

    def add(check: str, page: int, message: str) -> None:
        if sum(1 for v in report.violations if v.check == check) < MAX_REPORTS_PER_CHECK:
            rc = int(pool.rc[page]) if 0 <= page <= pool.capacity else -1
            holders = holders_of(kind, page, tree, requests)
            report.violations.append(IntegrityReport(check, kind, page, rc, holders, message))

    tree_refs = _tree_refs(kind, tree)
    req_refs: Counter[int] = Counter()
    for req in requests.values():
        req_refs.update(req.held(kind))
    quarantined = set(pool.quarantined_pages())
    # A1 (vectorised: production pools have 1e5+ pages)
    if pool.rc[0] != 0 or tree_refs[0] or req_refs[0]:
        add("A1", 0, "the NULL page has a reference")
    expected = np.zeros(pool.capacity + 1, dtype=np.int64)
    for refs in (tree_refs, req_refs):
        pages = np.fromiter((p for p in refs if 0 < p <= pool.capacity), dtype=np.int64)
        expected[pages] += np.fromiter((refs[int(p)] for p in pages), dtype=np.int64)
    skip = np.zeros(pool.capacity + 1, dtype=bool)
    retired = set(pool.retired_pages())
    skip[list(quarantined | retired)] = True
    skip[0] = True
    for page in np.flatnonzero((pool.rc != expected) & ~skip):
        page = int(page)
        add("A1", page, f"rc != {tree_refs[page]} tree + {req_refs[page]} request references")
    # A2
    free = pool.free_pages()
    counts = Counter(free)
    for page, c in counts.items():
        if c > 1:
            add("A2", page, f"on the free list {c} times")
        if page == 0:
            add("A2", page, "NULL page on the free list")
        elif page in quarantined:
            add("A2", page, "quarantined page on the free list")
        elif page in retired or page > pool.target:
            add("A2", page, "page above the shrink target on the free list")
        elif page > pool.capacity or pool.rc[page] != 0:
            add("A2", page, "held page on the free list")
    on_free = np.zeros(pool.capacity + 1, dtype=bool)
    on_free[[p for p in counts if 0 <= p <= pool.capacity]] = True
    for page in np.flatnonzero((pool.rc == 0) & ~on_free & ~skip):
        add("A2", int(page), "page with rc 0 missing from the free list (leaked)")
    # A3 (page part)
    for page, c in tree_refs.items():
        if c > 1:
            add("A3", page, f"page in {c} tree entries")
        if page in retired:
            add("A3", page, "retired page in the tree")
        if kind == "state" and req_refs[page]:
            add("A3", page, "snapshot slot also held by a request (its steps would write the snapshot)")
    # A5
    if idle:
        tree_pages = sum(1 for p in tree_refs if p not in quarantined)
        if len(free) + tree_pages != pool.capacity - len(quarantined) - len(retired):
            add(
                "A5",
                0,
                f"free({len(free)}) + tree({tree_pages}) != capacity({pool.capacity}) "
                f"- quarantined({len(quarantined)}) - retired({len(retired)})",
            )


def _audit_tree(tree: RadixTree, report: AuditReport) -> None:
    p = tree.page_size
    for node in tree.nodes():
        where = f"node#{node.uid} [{node.start},{node.end})"
        bad = ""
        if node.npages == 0:
            bad = "empty node"
        elif len(node.key) != node.npages * p or len(node.swa) != node.npages or len(node.state) != node.npages:
            bad = "node length not page-aligned or tables of different lengths"
        elif 0 in node.full:
            bad = "NULL full entry"
        elif node.parent is None or node.start != node.parent.end:
            bad = "node not attached at its parent's end"
        elif node.live != sum(1 for s in node.swa if s):
            bad = "live SWA count is stale"
        if bad:
            report.violations.append(IntegrityReport("A3", "full", 0, 0, (where,), bad))
    held = tree.owned("state")
    for slot, request in tree.ends.items():  # the snapshot policy's record follows the tree's slots
        if slot not in held:
            report.violations.append(
                IntegrityReport(
                    "A3", "state", slot, 0, (f"ends of request #{request}",), "an end the tree does not hold"
                )
            )


def _audit_request(req: RequestTables, page_size: int, window: int | None, report: AuditReport) -> None:
    if 0 in req.full:
        i = req.full.index(0)
        report.violations.append(IntegrityReport("A4", "full", 0, 0, (f"request {req.rid}",), f"NULL full[{i}]"))
    if req.draft_pending:
        report.violations.append(
            IntegrityReport("A6", "full", 0, 0, (f"request {req.rid}",), "verified chunk never resolved (accept)")
        )
    elif req.drafted and len(req.full) > num_pages(req.next_pos, page_size):
        page = req.full[-1]
        report.violations.append(
            IntegrityReport(
                "A6",
                "full",
                page,
                0,
                (f"request {req.rid} full[{len(req.full) - 1}]",),
                f"{len(req.full)} pages held past the {req.next_pos} written tokens (rejected draft not released)",
            )
        )
    if req.swa is None or window is None:
        return
    if len(req.swa) != len(req.full):
        report.violations.append(IntegrityReport("A4", "swa", 0, 0, (f"request {req.rid}",), "tables differ in length"))
        return
    first = first_window_page(req.next_pos, window, page_size)
    for i, page in enumerate(req.swa):
        if (i < first) == (page == 0):
            continue
        state = "live out of" if i < first else "NULL inside"
        report.violations.append(
            IntegrityReport(
                "A4",
                "swa",
                page,
                0,
                (f"request {req.rid} swa[{i}]",),
                f"entry {state} the window (next_pos {req.next_pos}, W {window})",
            )
        )


def run_audit(
    *,
    full_pool: PagePool,
    swa_pool: PagePool | None,
    tree: RadixTree | None,
    requests: Mapping[str, RequestTables],
    page_size: int,
    window: int | None,
    idle: bool,
    state_pool: PagePool | None = None,
) -> AuditReport:
    """Recount everything; `idle` adds A5 (call it only when no request holds pages)."""
    report = AuditReport()
    for pool in (full_pool, swa_pool, state_pool):
        if pool is not None:
            _audit_pool(pool, tree, requests, idle, report)
    if tree is not None:
        _audit_tree(tree, report)
    for req in requests.values():
        _audit_request(req, page_size, window, report)
    return report
