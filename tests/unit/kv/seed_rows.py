"""The known failure (DESIGN.md §3) and its ablation rows, played through the engine.

A: a prompt several windows long, still running. B: a short prompt sharing A's first tokens,
arriving when A has one prefill chunk left, so the scheduler batches B's prefill with A's last
chunk under one budget. `run_row` plays one row on the real engine over a null model and
returns what happened (B's hit, whether A's shared head was tombstoned and held by A when B
arrived, how many tokens B decoded beside A), so tests can assert the row's preconditions.

`ReferenceDefect` (a `CheckedKV`) injects the reference engine's actual defect, so that the
negative control can show which rows it kills.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine_sim import Setup, drain, make_engine, step, submit
from freetoken.engine.engine import Engine
from freetoken.kv.window import floor_to_page, hit_length
from freetoken.request import Request
from shadow import CheckedKV, path_entries

WINDOW = 16
CHUNK = 24
# A's prompt is over four windows long. With `a_len` 78 its chunks are 24 x 3 + 6, leaving 18
# tokens of its last step's budget for B (B's 8-token prompt runs in one chunk beside A's last);
# with 88 they are 24 x 3 + 16, leaving 8, so B's 10-token prompt takes two chunks and its
# first (8 tokens: two whole pages even at page size 4), committed beside A, ends inside B's own
# tokens. A's first commit (24 tokens) keeps only
# the window before 24 live, so the shared head is a tombstone by the commit policy alone. B's
# live run after the head stays shorter than the window (as in the reference: 3 + 7 tokens
# against 128), so a window-rule re-match of B's commit is refused.
A_PROMPT = [1 + (i * 37) % 60 for i in range(88)]


@dataclass(frozen=True)
class Row:
    name: str
    dies: bool  # the reference engine dies on this row
    page_size: int = 1
    b_shared: int = 5  # tokens of A's prompt B starts with
    b_own: int = 3  # B's own prompt tokens after them (3: one chunk beside A's last; 11: two)
    b_max: int = 4
    a_max: int = 12
    head: str = "policy"  # "evicted": a forced SWA pass before B arrives
    sequential: bool = False  # B arrives after A finished
    a_len: int = 78
    max_running: int = 4
    cache_type: str = "radix"
    # B's first commit beside A holds pages of B's own. Not so when B shares 20 tokens at page
    # size 4: B's first chunk (18 tokens) commits only shared pages and FreeToken heals the
    # head with B's live SWA pages, so no later commit of B is beneath a tombstone.
    key_step: bool = True

    @property
    def b_prompt(self) -> list[int]:
        return A_PROMPT[: self.b_shared] + [70 + i for i in range(self.b_own)]


def _seed_rows() -> list[Row]:
    rows = []
    for p in (1, 4):
        for head in ("policy", "evicted"):
            rows.append(Row(f"seed p{p} {head} B-first", True, p, head=head))
            rows.append(Row(f"seed p{p} {head} A-first", True, p, head=head, a_max=4, b_max=4))
            rows.append(Row(f"seed p{p} {head} B in two chunks", True, p, b_own=5, head=head,
                            a_len=88))
        rows.append(Row(f"seed p{p} B shares 20 tokens", True, p, b_shared=20, head="evicted",
                        key_step=p == 1))
        rows.append(Row(f"seed p{p} B max_tokens 2", True, p, b_max=2))
        rows.append(Row(f"seed p{p} B max_tokens 8", True, p, b_max=8))
    return rows


SEED_ROWS = _seed_rows()
ABLATION_ROWS = [
    row
    for p in (1, 4)
    for row in (
        Row(f"ablation p{p} B max_tokens 1", False, p, b_max=1),
        Row(f"ablation p{p} B prompt distinct", False, p, b_shared=0, b_own=8),
        Row(f"ablation p{p} B after A finished", False, p, sequential=True),
        Row(f"ablation p{p} max-running-requests 1", False, p, max_running=1),
        Row(f"ablation p{p} two short prompts", False, p, a_len=8),
        Row(f"ablation p{p} A alone", False, p, b_shared=-1),
    )
] + [Row("ablation naive cache", False, 1, cache_type="naive")]


@dataclass
class Facts:
    a: Request
    b: Request | None
    kv: CheckedKV
    head_tombstoned_and_held: bool  # when B arrived, every shared head entry was a tombstone
    b_decodes_beside_a: int  # steps in which B decoded while A was in flight


def run_row(row: Row, kv_class: type[CheckedKV] = CheckedKV) -> Facts:
    setup = Setup(row.page_size, WINDOW, full_pages=256 // row.page_size,
                  swa_pages=256 // row.page_size, max_running=row.max_running, chunk=CHUNK,
                  cache_type=row.cache_type)
    engine = make_engine(setup, kv_class)
    kv: CheckedKV = engine.kv  # type: ignore[assignment]
    if isinstance(kv, ReferenceCommits):
        kv.engine = engine
    a = submit(engine, "A", A_PROMPT[: row.a_len], row.a_max)
    b: Request | None = None
    facts = Facts(a, None, kv, False, 0)
    while engine.has_work() or (b is None and row.b_shared >= 0):
        if b is None and row.b_shared >= 0:
            last_chunk = len(a.prompt_ids) - a.num_computed <= CHUNK
            if (a.finished if row.sequential else last_chunk) and engine.steps > 0:
                if row.head == "evicted":
                    kv.evict("swa", 10_000)
                facts.head_tombstoned_and_held = _head_tombstoned_and_held(kv, row)
                b = facts.b = submit(engine, "B", row.b_prompt, row.b_max)
        b_decoding = b is not None and b.output_ids and not b.finished
        a_in_flight = not a.finished
        step(engine)
        if b_decoding and a_in_flight:
            facts.b_decodes_beside_a += 1
    drain(engine)
    return facts


def _head_tombstoned_and_held(kv: CheckedKV, row: Row) -> bool:
    if kv.tree is None or row.b_shared < kv.page_size:
        return False
    entries = path_entries(kv, row.b_prompt[: floor_to_page(row.b_shared, kv.page_size)])
    held = set(kv._requests["A"].full) if "A" in kv._requests else set()
    return bool(entries) and all(n.swa[j] == 0 and n.full[j] in held for n, j in entries)


# -- the reference engine's defect, mapped onto reference counts ------------------------------


class ReferenceCommits(CheckedKV):
    """The reference's cache behaviour around its defect, without the defect itself.

    1. Commit points: after every step a running request took part in (each prefill chunk,
       the sampling one included, and each decode step), its written tokens are committed
       unfinished (FreeToken commits only prefill chunks that do not sample).
    2. A tombstone on a path another running request holds is kept a tombstone by a commit
       (the reference's insert leaves a locked tombstone alone; FreeToken heals it).
    Neither frees anything: every row passes with these alone.
    """

    engine: Engine

    def release_out_of_window(self, rid: str, next_pos: int) -> int:
        req = self.engine.requests[rid]
        tokens = req.all_ids[:next_pos]
        self.commit(rid, tokens, req.boundaries)
        self.unfinished_commit(rid, tokens)
        return super().release_out_of_window(rid, next_pos)

    def unfinished_commit(self, rid: str, tokens: Sequence[int]) -> None:
        """Hook: what the reference does after an unfinished commit."""

    def commit(
        self, rid: str, tokens: Sequence[int], boundaries: Sequence[int] = (), resend_at: int | None = None
    ) -> None:
        tree = self.tree
        if tree is None or self.swa_pool is None:
            return super().commit(rid, tokens, boundaries, resend_at)
        others = {p for r, t in self._requests.items() if r != rid for p in t.full}
        locked = {n.full[j] for n, j in path_entries(self, tokens)
                  if n.swa[j] == 0 and n.full[j] in others}
        super().commit(rid, tokens, boundaries, resend_at)
        for node in tree.nodes():
            for j, (f, s) in enumerate(zip(node.full, node.swa)):
                if s and f in locked:  # undo the heal: the tree drops the reference it took
                    node.swa[j] = 0
                    node.live -= 1
                    del tree._swa_at[s]
                    tree._refresh(node)
                    self.swa_pool.decref([s])
        self.verify(f"commit({rid}) with locked tombstones kept")


class ReferenceDefect(ReferenceCommits):
    """The defect (reference report 000): after an unfinished commit the request re-matches
    its committed tokens; the window rule may refuse them (a short live run under a
    tombstone: cached length 0), so the request keeps no claim on its own committed nodes.
    The finish-time commit then treats every live entry it walks from that cached length on
    as the tree's canonical copy and frees the request's "duplicate" - which, for the nodes
    the request itself committed, is the very page the tree entry holds. The tree entry
    stays and names a free page (reference: free + tree = capacity + those pages)."""

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)
        self.accepted: dict[str, int] = {}  # the reference's cache handle length per request
        self.doomed: dict[str, list[tuple[int, int]]] = {}
        self.refused = 0

    def admit(self, rid: str, tokens: Sequence[int], *, use_cache: bool = True, boundaries: Sequence[int] = (),
              prompt_len: int | None = None) -> int:
        cached = super().admit(rid, tokens, use_cache=use_cache, boundaries=boundaries, prompt_len=prompt_len)
        self.accepted[rid] = cached
        return cached

    def unfinished_commit(self, rid: str, tokens: Sequence[int]) -> None:
        n = floor_to_page(len(tokens), self.page_size)
        if self.tree is None or n == 0:
            return
        entries = path_entries(self, tokens[:n])
        live = None if self.swa_pool is None else [nd.swa[j] != 0 for nd, j in entries]
        # the reference's match_prefix(tokens[:n]) has no cap: pass n + 1 tokens' worth
        length = hit_length(len(entries), live, n + 1, self.page_size, self.window)
        if length < n:
            self.refused += 1
        self.accepted[rid] = length
        self.doomed.pop(rid, None)  # the last commit was unfinished: the request goes on

    def commit(
        self, rid: str, tokens: Sequence[int], boundaries: Sequence[int] = (), resend_at: int | None = None
    ) -> None:
        if self.tree is not None:
            req = self._requests[rid]
            start = self.accepted.get(rid, 0) // self.page_size
            self.doomed[rid] = [
                (nd.full[j], nd.swa[j])
                for i, (nd, j) in enumerate(path_entries(self, tokens))
                if i >= start and i < len(req.full) and nd.swa[j] and nd.full[j] == req.full[i]
            ]
        super().commit(rid, tokens, boundaries, resend_at)

    def release(self, rid: str, *, preempted: bool = False) -> None:
        for full, swa in self.doomed.pop(rid, []):
            self.full_pool.decref([full])  # "free" the tree's own page; the node still names it
            if swa and self.swa_pool is not None and self.swa_pool.rc[swa] > 0:
                self.swa_pool.decref([swa])
        self.accepted.pop(rid, None)
        super().release(rid, preempted=preempted)
