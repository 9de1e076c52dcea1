"""Speculative decoding under the KV tests' content oracle: the pieces the drafting drivers share.

`next_token` is the null model's greedy choice (a function of the last token and the position, so
n-gram drafts are often right and break every few tokens: every j from 0 to k occurs);
`DraftingRunner` computes verified chunks with it; `SpecKV` is the `CheckedKV` that also checks
after `extend_draft` and `accept` and forgets the rejected tokens in the shadow; `Watch` steps an
engine and checks after every step that the tree holds only real sequences. Used by
tests/engine/test_engine_speculative_kv.py and the mixed driver (mixed_sim.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine_sim import VOCAB, NullRunner
from shadow import CheckedKV, ShadowViolation

from freetoken.engine.engine import Engine
from freetoken.engine.scheduler import ScheduledItem
from freetoken.kv.audit import run_audit
from freetoken.kv.window import num_pages
from freetoken.request import Request


def next_token(prefix: Sequence[int]) -> int:
    """The null model's greedy choice: a cycle of 4 tokens whose range shifts every 7 positions."""
    return (prefix[-1] + 1) % 4 + 4 * ((len(prefix) // 7) % 3)


class SpecKV(CheckedKV):
    """CheckedKV that also checks after the draft's calls, and forgets the rejected tokens'
    writes in the shadow (their slots are no longer claimed by anyone). A6 holds between steps
    only (mid-step a draft is pending, or a table is grown for the next token), so the check
    after each call leaves it out and `end_step` runs it."""

    def verify(self, after: str) -> None:
        self.checks += 1
        report = run_audit(full_pool=self.full_pool, swa_pool=self.swa_pool, tree=self.tree,
                           requests=self._requests, page_size=self.page_size,
                           window=self.window, idle=not self._requests)
        problems = self.shadow.problems(self) + [str(v) for v in report.violations if v.check != "A6"]
        if problems:
            raise ShadowViolation(f"after {after}:\n  " + "\n  ".join(problems))

    def end_step(self) -> None:
        super().end_step()
        report = self.audit(idle=not self._requests)
        assert report.ok, f"between steps:\n{report}"

    def extend_draft(self, rid: str, num_tokens: int) -> bool:
        ok = super().extend_draft(rid, num_tokens)
        self.counts["draft" if ok else "draft refused (no free pages)"] += 1
        self.verify(f"extend_draft({rid}, {num_tokens}) -> {ok}")
        return ok

    def accept(self, rid: str, written: int) -> int:
        shadow = self.shadow.requests[rid]
        if shadow.valid - 1 > written:
            self.counts["rejected draft tokens"] += 1
        before = len(self._requests[rid].full)
        released = super().accept(rid, written)
        if released:
            self.counts["pages of rejected tokens released"] += 1
        if self.shadow.enabled and before - released != num_pages(written, self.page_size):
            raise ShadowViolation(f"accept({rid}, {written}) kept {before - released} pages for "
                                  f"{written} written tokens, not {num_pages(written, self.page_size)}")
        shadow.tokens, shadow.ids = shadow.tokens[:written], shadow.ids[:written]
        shadow.valid = min(shadow.valid, written)
        self.verify(f"accept({rid}, {written})")
        return released


class DraftingRunner(NullRunner):
    """NullRunner that computes verified chunks: every row of one gives a logit row."""

    def forward(self, items: list[ScheduledItem]) -> torch.Tensor:
        prefixes: list[list[int]] = []
        for item in items:
            req = item.req
            tokens = req.token_slice(0, item.start + item.n - len(item.draft)) + list(item.draft)
            self.kv.forward(req.rid, tokens, item.start, item.n)
            if item.all_logits or item.draft:
                prefixes.extend(tokens[: item.start + i + 1] for i in range(item.n))
            elif item.samples:
                prefixes.append(tokens)
        logits = torch.zeros(len(prefixes), VOCAB)
        for r, prefix in enumerate(prefixes):
            logits[r, next_token(prefix)] = 1.0
        return logits


class Watch:
    """Steps an engine and checks, after each step, that the tree holds only real sequences."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.seen: dict[str, Request] = {}

    def track(self, reqs: Sequence[Request]) -> None:
        for r in reqs:
            self.seen[r.rid] = r

    def step(self) -> None:
        self.track(list(self.engine.requests.values()))
        self.engine.step()
        self.engine.kv.end_step()  # type: ignore[attr-defined]
        self.check_tree()

    def check_tree(self) -> None:
        tree = self.engine.kv.tree
        if tree is None:
            return
        sequences = [tuple(r.all_ids) for r in self.seen.values()]
        paths: dict[int, tuple[int, ...]] = {id(tree.root): ()}
        for node in tree.nodes():
            path = paths[id(node.parent)] + tuple(node.key)
            paths[id(node)] = path
            assert any(s[: len(path)] == path for s in sequences), (
                f"tree node#{node.uid} [{node.start},{node.end}) holds a sequence no request produced"
            )

    def drain(self) -> None:
        for _ in range(5000):
            if not self.engine.has_work():
                break
            self.step()
        assert not self.engine.has_work()
        kv: SpecKV = self.engine.kv  # type: ignore[assignment]
        kv.verify("drain (idle)")
        report = kv.audit(idle=True)
        assert report.ok, str(report)
