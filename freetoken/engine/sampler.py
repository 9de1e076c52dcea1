"""Choosing the next token of each request from its logits.

Owns penalties, temperature, top-k, top-p, min-p, seeded draws and logprobs. The logit
transformations run batched over the requests of a step; only the random draw with a
per-request generator walks the rows. It never touches KV memory or request queues.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from freetoken.request import Request, SamplingParams, TokenLogprob


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]


def _penalize(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """Repetition (over prompt + output), frequency and presence (over output) penalties."""
    # logits: [N, V]
    out = logits
    for i, req in enumerate(requests):
        p = req.params
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(req.all_ids)), dtype=torch.long)
            row = out[i, seen]
            out[i, seen] = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
        if (p.frequency_penalty or p.presence_penalty) and req.output_ids:
            ids = torch.tensor(req.output_ids, dtype=torch.long)
            counts = torch.zeros(out.shape[1], dtype=out.dtype).scatter_add_(0, ids, torch.ones_like(ids, dtype=out.dtype))
            out[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(out.dtype)
    return out


def _filter(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p masks, batched. Greedy rows are left alone."""
    # logits: [N, V] float32
    n, vocab = logits.shape
    if any(p.temperature not in (0.0, 1.0) for p in params):
        temps = torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params], dtype=logits.dtype)
        logits = logits / temps[:, None]
    top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params])
    top_p = torch.tensor([p.top_p for p in params], dtype=logits.dtype)
    min_p = torch.tensor([p.min_p for p in params], dtype=logits.dtype)
    if bool((top_k < vocab).any() or (top_p < 1.0).any() or (min_p > 0).any()):
        sorted_logits, order = logits.sort(dim=-1, descending=True)  # [N, V]
        probs = sorted_logits.softmax(dim=-1)
        rank = torch.arange(vocab)[None, :]
        drop = rank >= top_k[:, None]
        # keep the smallest prefix whose mass reaches top_p (the token that crosses it stays)
        drop |= (probs.cumsum(dim=-1) - probs) >= top_p[:, None]
        drop |= probs < (min_p[:, None] * probs[:, :1])
        drop[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
    return logits


def _logprob_of(logprobs_row: torch.Tensor, token_id: int, k: int) -> TokenLogprob:
    top: list[tuple[int, float]] = []
    if k > 0:
        values, ids = logprobs_row.topk(k)
        top = [(int(i), float(v)) for i, v in zip(ids, values)]
    return TokenLogprob(token_id, float(logprobs_row[token_id]), top)


def sample(logits: torch.Tensor, requests: list[Request]) -> SampleResult:
    """One token per request; `logits[i]` belongs to `requests[i]` (penalties edit it in place)."""
    # logits: [N, V]
    logits = logits.float()
    params = [r.params for r in requests]
    raw_logprobs = logits.log_softmax(dim=-1) if any(p.logprobs is not None for p in params) else None
    if any(p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty for p in params):
        _penalize(logits, requests)
    chosen = [0] * len(requests)
    greedy = [i for i, p in enumerate(params) if p.greedy]
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    if greedy:
        for i, tok in zip(greedy, logits[greedy].argmax(dim=-1).tolist()):
            chosen[i] = tok
    if sampled:
        probs = _filter(logits[sampled], [params[i] for i in sampled]).softmax(dim=-1)  # [S, V]
        cdf = probs.cumsum(dim=-1)  # [S, V]
        # Inverse-CDF draw, one uniform number per request from its own generator (seeded
        # requests are reproducible whatever else is in the batch).
        u = torch.stack([torch.rand((), generator=requests[i].generator, dtype=cdf.dtype) for i in sampled])
        picks = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None]).clamp_(max=logits.shape[1] - 1)
        for row, i in enumerate(sampled):
            chosen[i] = int(picks[row, 0])
    logprobs: list[TokenLogprob | None] = []
    for i, p in enumerate(params):
        if p.logprobs is None or raw_logprobs is None:
            logprobs.append(None)
        else:
            logprobs.append(_logprob_of(raw_logprobs[i], chosen[i], p.logprobs))
    return SampleResult(chosen, logprobs)


def prompt_logprobs(logits: torch.Tensor, next_ids: list[int], k: int) -> list[TokenLogprob]:
    """Logprobs of each prompt token given the ones before it; row j predicts `next_ids[j]`."""
    # logits: [M, V]
    lp = logits.float().log_softmax(dim=-1)
    return [_logprob_of(lp[j], t, k) for j, t in enumerate(next_ids)]
