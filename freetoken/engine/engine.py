"""The engine loop: `step()` = schedule -> forward -> sample -> emit -> commit -> release.

With `--speculative ngram` a decode row may be a verified chunk (the last token + k drafted
ones, scheduler.py): its 1 + k rows are sampled as usual, the longest confirmed prefix and the
token after it are kept (speculative.py), and the step's release starts with `KVManager.accept`,
which gives back the pages only rejected tokens were written to (commits cover kept tokens only).

With the disk tier (`--kv-disk-dir`, kv/disk_tier.py) every commit is followed by a write-behind
of the pages not yet on disk (copied here, written by the tier's thread, never waited for), and
`close` writes the backlog at shutdown.

A request with a reasoning budget (freetoken/reasoning_budget.py) whose budget is spent gets the
close of its reasoning forced: its row is sampled as usual and the forced token replaces the draw.

Owns the requests in flight, finishing them (EOS, stop ids, max_tokens, context, a completed
grammar — constrained rows are masked before sampling, see `grammar.py`), aborts, and
integrity handling: a `KVIntegrityError` or a failed audit is logged with its full report, its
pages quarantined and the requests holding them ended with an error, and serving goes on —
unless `debug_kv` is set, where it is fatal so that tests surface bugs. It sees token ids only.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field, replace

import torch

from freetoken.config import ResolvedConfig
from freetoken.engine.grammar import GrammarCompiler, GrammarError, GrammarSet
from freetoken.engine.resize import ResizeRefused, resize_memory, settle, state_floor
from freetoken.engine.runner import Runner
from freetoken.engine.sample_step import Kept, sample_step
from freetoken.engine.sampler import prompt_logprobs
from freetoken.engine.scheduler import ScheduledItem, Scheduler
from freetoken.errors import FreeTokenError
from freetoken.kv.disk_tier import DiskTier
from freetoken.kv.errors import KVIntegrityError
from freetoken.kv.manager import KVManager
from freetoken.models.experts import expert_cache, expert_status
from freetoken.reasoning_budget import ReasoningState
from freetoken.request import CacheReport, FinishReason, Request, RequestStatus, TokenLogprob

log = logging.getLogger("freetoken.engine")


class RequestRefused(FreeTokenError):
    """A request the engine can never serve; `code` is a machine-readable reason."""

    def __init__(self, message: str, code: str = "invalid_request", param: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.param = param


@dataclass
class RequestUpdate:
    """What happened to one request in one step."""

    rid: str
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: list[TokenLogprob | None] = field(default_factory=list)
    finished: bool = False
    finish_reason: FinishReason | None = None
    error: str | None = None
    report: CacheReport = CacheReport()  # the request's, as of this step (none: an end outside a step)
    prompt_logprobs: list[TokenLogprob | None] | None = None  # on the first update, when asked


def _update_of(req: Request) -> RequestUpdate:
    """A new update of `req`, carrying its cache report."""
    return RequestUpdate(req.rid, report=req.report)


class Engine:
    def __init__(
        self,
        config: ResolvedConfig,
        runner: Runner,
        kv: KVManager,
        grammars: GrammarCompiler | None = None,
        disk: DiskTier | None = None,
    ) -> None:
        self.config = config
        self.runner = runner
        self.kv = kv
        self.disk = disk  # the disk tier under the prefix cache (kv/disk_tier.py), None without --kv-disk-dir
        self.grammars = GrammarSet(grammars)  # matchers of requests with `params.grammar`
        self.scheduler = Scheduler(kv, config, disk)
        self.requests: dict[str, Request] = {}
        self.steps = 0
        self.drafted_tokens = 0  # speculative decoding, since start (the /metrics counters)
        self.accepted_tokens = 0
        self.prefilled_tokens = 0  # prompt tokens computed (cache hits excluded), since start
        self._pending: dict[str, RequestUpdate] = {}  # updates produced outside step()

    # -- requests in ----------------------------------------------------------------------

    def add_request(self, req: Request) -> None:
        """Queue `req`, or raise RequestRefused if it could never be served."""
        if req.rid in self.requests:
            raise RequestRefused(f"request id {req.rid!r} is already in flight")
        req.params.validate()
        vocab = self.runner.vocab_size
        if not req.prompt_ids:
            raise RequestRefused("the prompt is empty", param="prompt")
        if any(t < 0 or t >= vocab for t in req.prompt_ids):
            raise RequestRefused(f"prompt token ids must be in [0, {vocab})", param="prompt")
        total = len(req.prompt_ids) + req.params.max_tokens
        if total > self.config.context_length:
            raise RequestRefused(
                f"this request needs {len(req.prompt_ids)} prompt + {req.params.max_tokens} output tokens, "
                f"past the context length of {self.config.context_length}",
                code="context_length_exceeded",
                param="max_tokens",
            )
        pages = math.ceil(total / self.config.engine.page_size)
        if pages > self.kv.capacity("full"):
            raise RequestRefused(
                f"this request needs {total} tokens of KV memory; the pool holds "
                f"{self.kv.capacity('full') * self.config.engine.page_size}",
                code="context_length_exceeded",
                param="max_tokens",
            )
        if req.params.prompt_logprobs is not None and 2 * pages > self.kv.capacity("full"):
            # It reads no cache, so it recomputes a cached prefix of its prompt as its own pages
            # and commits the rest beneath that prefix, which then cannot be evicted while it
            # runs: it needs up to twice its pages (the resize floor's reason). With less, it
            # preempts itself at the same point on every resume and never finishes.
            raise RequestRefused(
                f"this request asks for prompt logprobs, so it reads no cached prefix and may need "
                f"twice its {total} tokens of KV memory; the pool holds "
                f"{self.kv.capacity('full') * self.config.engine.page_size}",
                code="context_length_exceeded",
                param="max_tokens",
            )
        if req.params.grammar is not None:
            try:
                self.grammars.start(req.rid, req.params.grammar)
            except GrammarError as err:
                raise RequestRefused(str(err), code="invalid_grammar", param="response_format") from None
        budget = req.params.reasoning_budget
        if budget is not None:
            if any(t >= vocab for t in budget.start_ids + budget.end_ids):
                raise RequestRefused(f"reasoning_budget token ids must be in [0, {vocab})", param="reasoning_budget")
            req.reasoning = ReasoningState(budget)
        if req.params.seed is not None:
            req.generator = torch.Generator().manual_seed(req.params.seed)
        self.requests[req.rid] = req
        self.scheduler.add(req)

    def abort(self, rid: str) -> None:
        """End a request now (client gone, stop string seen): commit, release, report."""
        self.finish(rid, FinishReason.ABORT)

    def finish(self, rid: str, reason: FinishReason, error: str | None = None) -> None:
        req = self.requests.get(rid)
        if req is None or req.finished:
            return
        self._finish(req, reason, error)
        self._pending[rid] = RequestUpdate(rid, finished=True, finish_reason=reason, error=error)

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self._pending)

    # -- one step -------------------------------------------------------------------------

    def step(self) -> list[RequestUpdate]:
        """Run one batch. Returns an update per request that changed."""
        updates = self._pending
        self._pending = {}
        try:
            self._step(updates)
        except KVIntegrityError as err:
            self.kv.record_error(err)
            self._integrity_failure(err, updates)
            return list(updates.values())
        settle(self.kv, self.runner.resize_kv)  # a shrink completes once its pages are released
        idle = not self.scheduler.has_work()
        if idle or self.config.engine.debug_kv:
            self._audit(idle, updates)
        return list(updates.values())

    def audit_now(self) -> list[RequestUpdate]:
        """Run the full audit between steps (the server does it periodically); a failure is
        handled as in `step`. Returns the updates of requests it ended."""
        updates: dict[str, RequestUpdate] = {}
        self._audit(not self.scheduler.has_work(), updates)
        return list(updates.values())

    def _audit(self, idle: bool, updates: dict[str, RequestUpdate]) -> None:
        report = self.kv.audit(idle=idle)  # counted in kv.status()["integrity"]
        if not report.ok:
            self._integrity_failure(KVIntegrityError(report.violations), updates)

    def _step(self, updates: dict[str, RequestUpdate]) -> None:
        """schedule -> forward -> sample -> emit -> commit -> release."""
        hold = self.scheduler.hold  # a test hook, None unless EngineConfig.test_hold (hold.py)
        if hold is not None:
            hold.wait_while_step_held()
        items = self.scheduler.schedule()  # sealed: each item's logit rows and page tables
        if not items:
            if hold is not None:
                hold.idle_wait()
            return
        self.steps += 1
        logits = self._forward(items)
        kept = self._sample(items, logits, updates)
        self._emit(kept, updates)
        self._commit(items, updates)
        self._release(items)

    def _forward(self, items: list[ScheduledItem]) -> torch.Tensor:
        """Write the K/V of every item's chunk; the logits of their rows (`item.logit_rows` each,
        in order). A chunk that asks for prompt logprobs has them recorded from its rows."""
        start = time.perf_counter()
        logits = self.runner.forward(items)
        elapsed = time.perf_counter() - start
        row = 0
        prefilled = 0
        for item in items:
            prefilled += max(0, min(item.n, len(item.req.prompt_ids) - item.start))
            item.req.num_computed += item.n  # a verified chunk: set again per token kept (_emit)
            if item.all_logits:
                self._record_prompt_logprobs(item, logits[row : row + item.n])
            row += item.logit_rows
        self.prefilled_tokens += prefilled
        if self.disk is not None and prefilled:
            self.disk.policy.observe_prefill(prefilled, elapsed)  # the rate a disk load competes with
        return logits

    def _sample(
        self, items: list[ScheduledItem], logits: torch.Tensor, updates: dict[str, RequestUpdate]
    ) -> list[Kept]:
        """The tokens each sampling item keeps (engine/sample_step.py); a row the grammar leaves no
        token ends its request with an error."""

        def dead(req: Request) -> None:
            self._end_with_error(req, "the grammar allows no next token", updates)

        return sample_step(items, logits, self.grammars, dead)

    def _emit(self, kept: list[Kept], updates: dict[str, RequestUpdate]) -> None:
        """Append each item's kept tokens to its request and its update, ending the requests they
        finish; through a verified chunk `num_computed` counts the K/V written for the tokens kept
        so far."""
        for item, toks, lps in kept:
            req = item.req
            upd = updates.setdefault(req.rid, _update_of(req))
            if not req.output_ids and req.params.prompt_logprobs is not None:
                upd.prompt_logprobs = req.prompt_logprobs
            if item.draft:
                self._count_draft(item, len(toks) - 1, upd)
            for m, (tok, lp) in enumerate(zip(toks, lps)):
                if item.draft:  # K/V is written for the last token and the m drafts kept so far
                    req.num_computed = item.start + 1 + m
                if self._append(req, tok, lp, upd, updates):
                    break

    def _commit(self, items: list[ScheduledItem], updates: dict[str, RequestUpdate]) -> None:
        """A prompt chunk's K/V becomes reusable now (the last one too: a request sharing the whole
        prompt can hit it while this one decodes), and the pins it reaches apply; decode steps
        commit at finish, and on a hybrid model also when they reach a page boundary (a state
        snapshot there, kv/manager.py)."""
        page = self.config.engine.page_size
        for item in items:
            req = item.req
            if item.prompt_chunk and req.status is RequestStatus.RUNNING:
                prompt_done = req.num_computed >= len(req.prompt_ids)
                resend_at = len(req.prompt_ids) - 1 if prompt_done else None
                self.kv.commit(req.rid, req.all_ids[: req.num_computed], req.boundaries, resend_at)
                self._save(req)
                self._pin(req, updates)
            elif (
                self.kv.state_pool is not None and req.status is RequestStatus.RUNNING and req.num_computed % page == 0
            ):
                # A hybrid model's state is at a page boundary only now: its snapshot there is
                # where the next request of a conversation (prompt + this output + more) hits.
                self.kv.commit(req.rid, req.all_ids[: req.num_computed], req.boundaries)

    def _save(self, req: Request) -> None:
        """Write-behind: the pages just committed go to the disk tier's writer (never waited for)."""
        if self.disk is not None:
            self.disk.save(self.kv, req.rid, req.all_ids[: req.num_computed])

    def _release(self, items: list[ScheduledItem]) -> None:
        """A verified chunk's pages that only rejected drafts were written to, then the SWA pages
        out of every running request's window, go back."""
        for item in items:
            req = item.req
            if req.status is not RequestStatus.RUNNING:
                continue  # finished (released whole) or preempted
            if item.draft:
                self.kv.accept(req.rid, req.num_computed)
            self.kv.release_out_of_window(req.rid, req.num_computed)

    def _append(
        self, req: Request, tok: int, lp: TokenLogprob | None, upd: RequestUpdate, updates: dict[str, RequestUpdate]
    ) -> bool:
        """Append one sampled token to `req` and its update; True when that ended the request."""
        req.output_ids.append(tok)
        if req.reasoning is not None:
            req.reasoning.advance(tok)
        if lp is not None:
            req.logprobs.append(lp)
        upd.new_token_ids.append(tok)
        upd.new_logprobs.append(lp)
        try:
            complete = self.grammars.advance(req.rid, tok)
        except GrammarError as err:
            self._end_with_error(req, str(err), updates)
            return True
        reason = FinishReason.STOP if complete else self._stop_reason(req, tok)
        if reason is not None:
            self._finish(req, reason)
            upd.finished, upd.finish_reason = True, reason
            return True
        return False

    def _count_draft(self, item: ScheduledItem, accepted: int, upd: RequestUpdate) -> None:
        """A verified chunk's statistics: the request's report, the engine's counters and the
        speculator's next window."""
        req = item.req
        drafted = len(item.draft)
        report = req.report
        req.report = replace(
            report, drafted_tokens=report.drafted_tokens + drafted, accepted_tokens=report.accepted_tokens + accepted
        )
        upd.report = req.report
        self.drafted_tokens += drafted
        self.accepted_tokens += accepted
        if self.scheduler.speculator is not None:
            self.scheduler.speculator.observe(req.rid, drafted, accepted)

    def _pin(self, req: Request, updates: dict[str, RequestUpdate]) -> None:
        """Apply the request's retention pins whose prefix is now committed (kv/pins.py)."""
        while req.pins_done < len(req.pins) and req.pins[req.pins_done][0] <= req.num_computed:
            end, ttl_s = req.pins[req.pins_done]
            req.pins_done += 1
            pinned = self.kv.pin(req.prompt_ids, int(end), float(ttl_s))
            report = req.report
            created = max(report.cache_creation_tokens, pinned - report.cached_tokens)
            req.report = replace(report, cache_creation_tokens=created)
        if req.rid in updates:
            updates[req.rid].report = req.report

    def _record_prompt_logprobs(self, item: ScheduledItem, chunk: torch.Tensor) -> None:
        prompt = item.req.prompt_ids
        if item.start == 0:
            item.req.prompt_logprobs = [None]
        end = min(item.start + item.n, len(prompt) - 1)  # row j predicts prompt[start + j + 1]
        if end > item.start:
            k = item.req.params.prompt_logprobs or 0
            next_ids = prompt[item.start + 1 : end + 1]
            item.req.prompt_logprobs.extend(prompt_logprobs(chunk[: end - item.start], next_ids, k))

    def _stop_reason(self, req: Request, tok: int) -> FinishReason | None:
        p = req.params
        if tok in p.stop_token_ids or (not p.ignore_eos and tok in req.eos_ids):
            return FinishReason.STOP
        if len(req.output_ids) >= p.max_tokens or req.num_tokens >= self.config.context_length:
            return FinishReason.LENGTH
        return None

    def _end_with_error(self, req: Request, error: str, updates: dict[str, RequestUpdate]) -> None:
        self._finish(req, FinishReason.ERROR, error)
        upd = updates.setdefault(req.rid, _update_of(req))
        upd.finished, upd.finish_reason, upd.error = True, FinishReason.ERROR, error

    def _finish(self, req: Request, reason: FinishReason, error: str | None = None) -> None:
        """Commit the tokens whose K/V is written (prompt + output - 1 at most), then release."""
        if req.status is RequestStatus.RUNNING and reason is not FinishReason.ERROR:
            self.kv.commit(req.rid, req.all_ids[: req.num_computed], boundaries=req.boundaries)
            self._save(req)
        self.kv.release(req.rid)
        self.scheduler.remove(req)
        self.grammars.drop(req.rid)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.error = error
        del self.requests[req.rid]

    # -- integrity ------------------------------------------------------------------------

    def _integrity_failure(self, err: KVIntegrityError, updates: dict[str, RequestUpdate]) -> None:
        """Log the full report; quarantine its pages and end the requests holding them. Fatal
        under `debug_kv`, so that tests surface the bug."""
        log.error("KV integrity failure:\n%s", "\n".join(str(r) for r in err.reports))
        if self.config.engine.debug_kv:
            raise err
        holders: set[str] = set()
        for kind, pages in err.pages().items():
            holders |= self.kv.quarantine(kind, sorted(pages))
        message = "the KV memory of this request failed an integrity check; its pages were quarantined"
        for rid in sorted(holders):
            req = self.requests.get(rid)
            if req is not None:
                self._finish(req, FinishReason.ERROR, message)
                updates[rid] = RequestUpdate(rid, finished=True, finish_reason=FinishReason.ERROR, error=message)

    def resize(
        self,
        full_tokens: int | None = None,
        swa_tokens: int | None = None,
        expert_cache_gb: float | None = None,
        state_slots: int | None = None,
    ) -> dict[str, dict[str, int]]:
        """Resize the KV pools (a hybrid model's state pool too) and/or the expert cache now
        (engine/resize.py); raises ResizeRefused."""
        if not self.runner.resizable:
            raise ResizeRefused("resizing the KV pools is not supported with tensor parallelism", "full_tokens")
        return resize_memory(
            self.kv,
            self.runner.resize_kv,
            self.requests.values(),
            expert_cache(self.runner.model),
            full_tokens=full_tokens,
            swa_tokens=swa_tokens,
            expert_cache_gb=expert_cache_gb,
            page_size=self.config.engine.page_size,
            swa_floor=self.config.swa_floor,
            state_slots=state_slots,
            state_floor=state_floor(self.config.engine.max_running_requests),
        )

    def close(self, timeout_s: float | None = None) -> bool:
        """Stop the engine's background work: the disk tier writes its backlog (up to
        `timeout_s`) and stops its writer. True when nothing was left unwritten."""
        return True if self.disk is None else self.disk.close(timeout_s)

    def status(self) -> dict[str, object]:
        """The `/v1/cache/status` document: the KV manager's pools and integrity, plus the floor,
        preemptions, experts and (speculation on) the drafted and accepted token counts."""
        doc = self.kv.status()
        if self.config.swa_floor is not None:
            doc["floor"] = self.config.swa_floor
        doc["preemptions"] = self.scheduler.preemptions
        experts = expert_status(self.runner.model)
        if experts is not None:
            doc["experts"] = experts  # strategy, and the offload cache's counters
        if self.disk is not None:
            doc["disk"] = self.disk.status()
        if self.scheduler.speculator is not None:
            doc["speculative"] = {
                "method": self.config.engine.speculative,
                "drafted_tokens": self.drafted_tokens,
                "accepted_tokens": self.accepted_tokens,
            }
        return doc
