"""Speculative decoding from the prompt (n-gram lookup): drafting and the acceptance rule.

Owns which requests draft (`eligible`), the per-request n-gram index that proposes the tokens
that followed the latest earlier occurrence of the sequence's last n tokens (prompt and output
alike), and verification: given the 1 + k tokens the sampler drew at the rows of a verified
chunk, how many of the k drafted tokens are accepted. It holds no KV pages (the scheduler grows
a request's tables for its draft, the engine resolves them with `KVManager.accept`) and does not
run the model.

The acceptance rule is exact for greedy and sampled requests alike. Greedy: the longest prefix
of the draft that matches the argmax of each row, plus the argmax after it. Sampled: the
standard speculative-sampling rule with a point-mass draft distribution q = delta(t) accepts t
with probability min(1, p(t) / q(t)) = p(t) and on rejection samples from (p - q)+ renormalised,
i.e. from p with t removed. Drawing x ~ p with the ordinary sampler and accepting iff x == t is
that same rule: P(accept) = p(t), and a rejected draw is x ~ p conditioned on x != t. So each
row is sampled as usual and the output distribution is unchanged. A seeded request draws one
uniform per row from its own generator; the engine rewinds it and redraws one per token kept,
so the generator ends where the non-speculative run's would (`rewind`): the same seed gives the
same tokens with and without speculation.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from freetoken.request import Request, SamplingParams


def eligible(params: SamplingParams) -> bool:
    """Whether a request may draft: it did not opt out, no grammar (its matcher would have to
    validate every drafted token), no penalties (they depend on the tokens before each row)."""
    return (
        params.speculative
        and params.grammar is None
        and params.repetition_penalty == 1.0
        and not params.frequency_penalty
        and not params.presence_penalty
    )


class NgramIndex:
    """Where each n-gram (n in [n_min, n_max]) of one request's tokens last occurred with a
    token after it. Updated incrementally: each step indexes only the tokens appended since."""

    def __init__(self, n_min: int, n_max: int) -> None:
        self.n_min = n_min
        self.n_max = n_max
        self.last: dict[tuple[int, ...], int] = {}  # gram -> end e (exclusive): tokens[e] follows it
        self.indexed = 0  # ends below this are indexed

    def update(self, req: Request) -> None:
        length = req.num_tokens
        start = max(self.indexed, self.n_min)
        if start >= length:
            return
        lo = max(0, start - self.n_max)
        tokens = req.token_slice(lo, length)
        for e in range(start, length):  # tokens[e] exists: the gram ending at e has a follower
            for n in range(self.n_min, min(self.n_max, e) + 1):
                self.last[tuple(tokens[e - n - lo : e - lo])] = e
        self.indexed = length

    def lookup(self, req: Request, k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest suffix
        n-gram found; [] when none of the suffixes occurred before."""
        length = req.num_tokens
        suffix = req.token_slice(max(0, length - self.n_max), length)
        for n in range(min(self.n_max, len(suffix)), self.n_min - 1, -1):
            e = self.last.get(tuple(suffix[len(suffix) - n :]))
            if e is not None:
                return req.token_slice(e, min(e + k, length))
        return []


class Speculator:
    """The drafts of every request in flight (`--speculative ngram`).

    Each request's draft length adapts, as a congestion window does: it starts at `max_draft`,
    doubles (up to `max_draft`) after a chunk accepted whole and falls to j + 1 after one that
    accepted j. A stream that copies keeps long drafts; one that strays stops paying for k rows
    it throws away. The length changes only the cost: any draft leaves the output exact."""

    def __init__(self, max_draft: int, ngram_min: int, ngram_max: int) -> None:
        self.max_draft = max_draft
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max
        self._indexes: dict[str, NgramIndex] = {}
        self._window: dict[str, int] = {}  # per request: the next draft's length at most

    def propose(self, req: Request) -> list[int]:
        """The draft of a decoding request: at most its window and never more than its output
        budget (or its reasoning budget's free tokens) leaves after the token the verification
        adds anyway."""
        if not eligible(req.params):
            return []
        k = min(self._window.get(req.rid, self.max_draft), req.params.max_tokens - len(req.output_ids) - 1)
        free = req.reasoning.free_tokens() if req.reasoning is not None else None
        if free is not None:
            k = min(k, free - 1)  # no row of the chunk may be one the budget forces
        if k < 1:
            return []
        index = self._indexes.get(req.rid)
        if index is None:
            index = self._indexes[req.rid] = NgramIndex(self.ngram_min, self.ngram_max)
        index.update(req)
        return index.lookup(req, k)

    def observe(self, rid: str, drafted: int, accepted: int) -> None:
        """A verified chunk's outcome: the request's next window."""
        self._window[rid] = min(self.max_draft, 2 * drafted) if accepted == drafted else accepted + 1

    def drop(self, rid: str) -> None:
        self._indexes.pop(rid, None)
        self._window.pop(rid, None)


def accepted(draft: Sequence[int], sampled: Sequence[int]) -> int:
    """j: how many leading drafted tokens the rows' own draws confirm (`sampled[i]` was drawn at
    the row after `draft[:i]`). The tokens kept are `sampled[: j + 1]`."""
    j = 0
    while j < len(draft) and sampled[j] == draft[j]:
        j += 1
    return j


def rewind(generator: torch.Generator, state: torch.Tensor, kept: int) -> None:
    """Put a seeded request's generator where `kept` single draws from `state` leave it (the
    sampler drew one uniform per row of the chunk; the rows after a rejection do not count)."""
    generator.set_state(state)
    for _ in range(kept):
        torch.rand((), generator=generator, dtype=torch.float32)
