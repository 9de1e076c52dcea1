"""Which requests run in the next step, and with how many tokens.

Owns the waiting and running queues, admission over both KV pools, chunked prefill within
`max_prefill_length`, preemption when a running request cannot grow, and (`--speculative ngram`)
turning decode rows into verified chunks of 1 + k tokens once every other need of the step is
met (a hybrid model's prompt chunks also end at the KV manager's snapshot points, `chunk_end`): a draft's pages may come from evicting the prefix cache, never from a preemption. Running out of a pool
is a scheduling condition here: a request waits, or the youngest running one is preempted; it is
never an exception. Once a step's batch is final it seals each item: which rows of the forward
give logits and which of those are sampled, and the request's page tables, decided once here and
read by the runner and the engine. With the disk tier (`--kv-disk-dir`) an admission's hit is
extended by a synchronous load from disk (kv/disk_tier.py) before the miss is explained. It does
not run the model or sample.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, replace

from freetoken.config import ResolvedConfig
from freetoken.engine.hold import TestHold
from freetoken.engine.speculative import Speculator
from freetoken.kv.disk_tier import DiskTier
from freetoken.kv.manager import KVManager, PageTables
from freetoken.kv.miss import CacheMiss
from freetoken.request import Request, RequestStatus


@dataclass
class ScheduledItem:
    """One request's share of a step: K/V for tokens [start, start + n) gets computed. A
    verified chunk is the request's last token followed by its `draft` (n = 1 + len(draft)).

    `seal` decides, once the step's batch is final, what the runner and the engine read: the
    last `logit_rows` rows of the chunk give logits (every row of a chunk that asks for prompt
    logprobs or is a verified chunk, else the last row when the item samples, else none); the
    last `sample_rows` of those are sampled (all 1 + k of a verified chunk, else one or none);
    `tables` are the request's FULL and SWA page tables as the forward reads them, `state_slot`
    its state slot (hybrid models; 0 otherwise)."""

    req: Request
    start: int
    n: int
    draft: tuple[int, ...] = ()  # no allocation per decode row when nothing is drafted
    logit_rows: int = 0  # set by `seal`
    sample_rows: int = 0
    tables: PageTables | None = None
    state_slot: int = 0

    @property
    def samples(self) -> bool:
        """True when this step computes the request's last known token, so it gets a new one
        (read before the step appends any token: `seal` keeps the answer as `sample_rows`)."""
        return self.start + self.n - len(self.draft) == self.req.num_tokens

    @property
    def all_logits(self) -> bool:
        """True for a prompt chunk of a request that asks for prompt logprobs."""
        return self.req.params.prompt_logprobs is not None and self.prompt_chunk

    @property
    def prompt_chunk(self) -> bool:
        """True when the chunk computes prompt tokens (its K/V is committed at the step's end)."""
        return self.start < len(self.req.prompt_ids)

    def seal(self, tables: PageTables, state_slot: int = 0) -> None:
        samples = int(self.samples)
        self.logit_rows = self.n if self.all_logits or self.draft else samples
        self.sample_rows = self.n if self.draft else samples
        self.tables = tables
        self.state_slot = state_slot


class Scheduler:
    def __init__(self, kv: KVManager, config: ResolvedConfig, disk: DiskTier | None = None) -> None:
        self.kv = kv
        self.disk = disk  # the disk tier under the prefix cache (--kv-disk-dir)
        self.config = config
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the last one is preempted first
        self.preemptions = 0
        engine = config.engine
        self.speculator = (
            Speculator(engine.spec_max_draft, engine.spec_ngram_min, engine.spec_ngram_max)
            if engine.speculative == "ngram"
            else None
        )
        self.hold = TestHold(engine.test_hold) if engine.test_hold else None  # a test hook (hold.py)

    def add(self, req: Request) -> None:
        self.waiting.append(req)
        if req.params.prompt_logprobs is None:  # hybrid models: its hit is kept while it waits
            self.kv.expect(req.rid, req.all_ids)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, req: Request) -> None:
        """Forget a request (finished or aborted); its pages are the caller's to release."""
        if self.speculator is not None:
            self.speculator.drop(req.rid)
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)

    # -- one step ---------------------------------------------------------------------------

    def schedule(self) -> list[ScheduledItem]:
        """The batch of the next step, each item sealed (its rows and page tables decided)."""
        items = self._batch()
        for item in items:
            item.seal(self.kv.page_tables(item.req.rid), self.kv.state_slot(item.req.rid))
        return items

    def _batch(self) -> list[ScheduledItem]:
        """Running requests first (oldest first), then admissions, then drafts."""
        budget = self.config.engine.max_prefill_length
        items: list[ScheduledItem] = []
        preempted_before = self.preemptions
        rule = self.hold.rule() if self.hold is not None else None
        for req in list(self.running):
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            remaining = req.num_tokens - req.num_computed
            if rule is not None and remaining == 1 and rule.holds(req):
                continue  # the test hook holds this decode row
            n = 1 if remaining == 1 else self._chunk(req, req.num_computed, min(remaining, budget))
            if n == 0:
                continue
            if not self._grow(req, req.num_computed + n, items):
                continue
            if remaining > 1:
                budget -= n
            items.append(ScheduledItem(req, req.num_computed, n))
        if self.preemptions != preempted_before:
            return items  # memory is short: admitting now would only take back what was freed
        while self.waiting and budget > 0 and len(self.running) < self.config.engine.max_running_requests:
            req = self.waiting[0]
            item = self._admit(req, budget)
            if item is None:
                break  # first come, first served: nobody overtakes a request that does not fit
            self.waiting.popleft()
            self.running.append(req)
            req.status = RequestStatus.RUNNING
            budget -= item.n
            items.append(item)
        if self.speculator is not None:
            self._draft(items, self.speculator)
        if not items and self.waiting and not self.running and self.kv.release_pins():
            return self._batch()  # pins held the pages the first waiting request needs alone
        return items

    def _admit(self, req: Request, budget: int) -> ScheduledItem | None:
        use_cache = req.params.prompt_logprobs is None
        cached = self.kv.admit(
            req.rid, req.all_ids, use_cache=use_cache, boundaries=req.boundaries, prompt_len=len(req.prompt_ids)
        )
        left_on_disk = False
        if use_cache and self.disk is not None:  # a synchronous load, committed before it returns
            loaded = self.disk.load(self.kv, req.rid, req.all_ids, cached, min(req.num_tokens - cached, budget))
            cached, left_on_disk = loaded.length, loaded.left_on_disk
        # Explained before `extend`, whose eviction would change what the tree held.
        miss = self.kv.explain_miss(req.rid, req.all_ids) if use_cache and not req.admitted_once else None
        if miss is not None and left_on_disk and miss.reason != "capped":
            miss = CacheMiss(miss.matched, "on_disk")
        n = self._chunk(req, cached, min(req.num_tokens - cached, budget))
        if not self.kv.extend(req.rid, cached + n):
            self.kv.release(req.rid)  # the lease goes back in the same step
            return None
        if not req.admitted_once:
            matched, reason = (0, None) if miss is None else (miss.matched, miss.reason)
            req.report = replace(req.report, cached_tokens=cached, matched_tokens=matched, miss_reason=reason)
            req.admitted_once = True
        req.num_computed = cached
        return ScheduledItem(req, cached, n)

    def _chunk(self, req: Request, start: int, n: int) -> int:
        """A chunk of `n` tokens from `start`, cut short where the KV manager wants the request's
        recurrent state for a snapshot (hybrid models: the step ends with the state there)."""
        return self.kv.chunk_end(req.rid, start, start + n) - start

    def _grow(self, req: Request, num_tokens: int, items: list[ScheduledItem]) -> bool:
        """Make `req`'s tables cover `num_tokens`, preempting the youngest requests as needed.
        False when `req` itself had to be preempted."""
        while not self.kv.extend(req.rid, num_tokens):
            # Requests are refused up front when they could never fit alone, so preempting the
            # youngest requests (at worst `req` itself) always ends this loop.
            victim = self.running[-1]
            if victim is req and self.kv.release_pins():
                continue  # pins held the pages `req` needs alone: a pin never starves a request
            self.preempt(victim)
            items[:] = [it for it in items if it.req is not victim]
            if victim is req:
                return False
        return True

    def _draft(self, items: list[ScheduledItem], speculator: Speculator) -> None:
        """Append a draft to each decode row that finds one and whose pages can be had."""
        for item in items:
            if item.n != 1 or not item.samples or not item.req.output_ids:
                continue
            draft = speculator.propose(item.req)
            if draft and self.kv.extend_draft(item.req.rid, item.start + 1 + len(draft)):
                item.draft = tuple(draft)
                item.n = 1 + len(draft)

    def preempt(self, req: Request) -> None:
        """Commit what `req` has written, release its pages and requeue it at the front."""
        self.kv.commit(req.rid, req.all_ids[: req.num_computed])
        if self.disk is not None:
            self.disk.save(self.kv, req.rid, req.all_ids[: req.num_computed])
        self.kv.release(req.rid, preempted=True)
        self.running.remove(req)
        req.status = RequestStatus.WAITING
        req.num_computed = 0
        req.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(req)
