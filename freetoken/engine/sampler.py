"""Choosing the next token of each request from its logits.

Owns penalties, temperature, top-k, top-p, min-p, seeded draws and logprobs. The logit
transformations run batched over the requests of a step; only the random draw with a
per-request generator walks the rows. It never touches KV memory or request queues.

The filters never sort a whole vocabulary row (262,144 entries for Gemma, tens of ms a row):
they run on the row's `torch.topk` survivors; a row whose cut may lie past them ranks every token
above a threshold proven to bound its last kept token instead, so the kept set and its
probabilities are those of the full-sort filter (`filtered_distribution`). Ties: tokens of equal (temperature-scaled) logit are ranked by
ascending token id, so a cut through a group of equal logits keeps the lowest ids, whatever order
`topk` returned them in and whatever else is in the batch.

The deep cut (`_deep_cut`: a flat row, top_p 0.95 keeping ~44,000 of 49,152 tokens on the
random-weight benchmark models) runs in the C++ kernel `ops.sampling.deep_cut` where it is built:
one pass sums exp(logit - max) in float64 into 1/128-logit buckets below the max, a sort of the one
bucket the cut falls in finds the last kept token (equal logits by ascending id), and a last pass
writes the kept ids ascending with their probabilities; 0.11 ms a row at 49,152 where the torch
ops took 2.2 (docs/engineering/kernels.md). The torch ops stay as its fallback (no extension, a
NaN in the row) and its reference: the kept set is the same, the probabilities agree to float64
rounding. A batch whose every row provably cuts past its topk (`_past_topk`) skips the topk, and
`sample` draws such a row from its own kept tensors (no padded batch of tens of thousands a row).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from freetoken.ops.sampling import deep_cut, exp_block_sums_, row_stats_
from freetoken.request import Request, SamplingParams, TokenLogprob

# (row maxima [R] float32, log normalisers [R] float64, block maxima [R, V / BLOCK] or None)
RowStats = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]
# a row decided past its topk -> (its kept ids ascending [m], their probabilities [m])
Kept = dict[int, tuple[torch.Tensor, torch.Tensor]]

# k of the topk for rows whose top_k is off: Gemma 3's rows keep 1-85 tokens at temperature 0.8,
# top_p 0.95 (benchmarks/sampler_bench.py --gguf); a row whose cut lies deeper takes the exact
# threshold path. On 40 real rows at temperature 0.8, top_p 0.95, one row per call: 128 against
# 256 took SmolLM2's (vocabulary 49152) from 0.41 to 0.33 ms and left Gemma 3's (262144) at ~0.58.
START_K = 128
# topk over a whole row copies it into (value, index) pairs; the k largest all lie in the k
# blocks of BLOCK entries with the largest maxima, so topk runs on those blocks' maxima and then
# on the k * BLOCK entries of the winning blocks (3-5x faster at 262k).
BLOCK = 64
# `_bounds` buckets the mass of a deep row by logit, below its max
BUCKETS_PER_LOGIT = 16
NUM_BUCKETS = 1024


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]


def _flat_ids(rows: list[int], id_lists: list[list[int]], vocab: int) -> torch.Tensor:
    """The keys `row * vocab + id` of every (row, id) pair, one tensor for all rows."""
    ids = torch.tensor(list(itertools.chain.from_iterable(id_lists)), dtype=torch.long)
    row = torch.repeat_interleave(torch.tensor(rows, dtype=torch.long), torch.tensor([len(x) for x in id_lists]))
    return row * vocab + ids


def _penalize(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """Repetition (over prompt + output), frequency and presence (over output) penalties.

    One gather / scatter over the distinct (row, token) pairs of all penalised rows; the float32
    arithmetic is the per-row loop's, so the results are bit for bit the same."""
    # logits: [N, V], edited in place
    vocab = logits.shape[1]
    rep = [i for i, r in enumerate(requests) if r.params.repetition_penalty != 1.0 and r.num_tokens]
    if rep:
        keys = torch.unique(_flat_ids(rep, [requests[i].prompt_ids + requests[i].output_ids for i in rep], vocab))
        rows, cols = keys // vocab, keys % vocab  # [P] each: distinct seen tokens per row
        pen = torch.tensor([r.params.repetition_penalty for r in requests], dtype=logits.dtype)[rows]
        vals = logits[rows, cols]
        logits[rows, cols] = torch.where(vals > 0, vals / pen, vals * pen)
    freq = [
        i for i, r in enumerate(requests) if (r.params.frequency_penalty or r.params.presence_penalty) and r.output_ids
    ]
    if freq:
        keys, counts = torch.unique(_flat_ids(freq, [requests[i].output_ids for i in freq], vocab), return_counts=True)
        rows, cols = keys // vocab, keys % vocab
        fp = torch.tensor([r.params.frequency_penalty for r in requests], dtype=logits.dtype)[rows]
        pp = torch.tensor([r.params.presence_penalty for r in requests], dtype=logits.dtype)[rows]
        logits[rows, cols] = logits[rows, cols] - (fp * counts.to(logits.dtype) + pp)
    return logits


def _add_logit_bias(logits: torch.Tensor, params: list[SamplingParams]) -> None:
    """Each row's `logit_bias` added in one scatter over the batch (a repeated id adds up)."""
    # logits: [N, V], edited in place
    biased = [i for i, p in enumerate(params) if p.logit_bias]
    if not biased:
        return
    pairs = [params[i].logit_bias for i in biased]
    rows = torch.repeat_interleave(torch.tensor(biased, dtype=torch.long), torch.tensor([len(b) for b in pairs]))
    cols = torch.tensor([t for b in pairs for t, _ in b], dtype=torch.long)
    vals = torch.tensor([v for b in pairs for _, v in b], dtype=logits.dtype)
    logits.index_put_((rows, cols), vals, accumulate=True)


def _has_filter(p: SamplingParams, vocab: int) -> bool:
    return 0 < p.top_k < vocab or p.top_p < 1.0 or p.min_p > 0.0


def _topk(x: torch.Tensor, k: int, block_max: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`x.topk(k)`, through the k blocks with the largest maxima when that is smaller (`block_max`
    [R, V / BLOCK]: those maxima, when the caller has them)."""
    # x: [R, V] -> values, ids: [R, k] (which of equal values come back is unspecified, as topk's)
    rows, vocab = x.shape
    if vocab % BLOCK or 2 * k * BLOCK > vocab:
        return x.topk(k, dim=-1)
    nblocks = vocab // BLOCK
    if block_max is None:
        block_max = x.reshape(rows, nblocks, BLOCK).amax(dim=-1)
    best = block_max.topk(k, dim=-1).indices  # [R, k]
    flat = (best + torch.arange(rows)[:, None] * nblocks).reshape(-1)
    candidates = x.reshape(rows * nblocks, BLOCK).index_select(0, flat).reshape(rows, k * BLOCK)
    vals, pos = candidates.topk(k, dim=-1)  # [R, k]
    return vals, best.gather(1, pos // BLOCK) * BLOCK + pos % BLOCK


def _ranked_topk(x: torch.Tensor, k: int, block_max: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest of each row, descending, equal values by ascending id."""
    # x: [R, V] -> values, ids: [R, k]
    vals, ids = _topk(x, k, block_max)
    ids, order = ids.sort(dim=-1)
    vals, order = vals.gather(1, order).sort(dim=-1, descending=True, stable=True)
    return vals, ids.gather(1, order)


@dataclass(frozen=True)
class _Filters:
    """The per-row filter settings of `filtered_distribution`, as tensors."""

    top_k: torch.Tensor  # [R] long, vocab when off
    top_p: torch.Tensor  # [R] float64
    min_p: torch.Tensor  # [R] float64
    row_max: torch.Tensor  # [R] float64, the row's largest logit
    log_mass: torch.Tensor  # [R] float64, log sum exp(logit - row_max) over the row (top_p rows)

    def rows(self, r: torch.Tensor | slice) -> _Filters:
        return _Filters(self.top_k[r], self.top_p[r], self.min_p[r], self.row_max[r], self.log_mass[r])


def _cut(vals: torch.Tensor, f: _Filters) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """How many of each row's leading candidates the filters keep.

    `vals` are the row's W largest logits in rank order. Returns the kept count m, p / p_max of
    the candidates, and whether no token past the candidates can be kept (the cut is inside them)."""
    # vals: [R, W] -> m: [R] long, rel: [R, W] float64, closed: [R] bool
    v = vals.double()
    rel = torch.exp(v - v[:, :1])  # p_r / p_max
    p = torch.exp(v - f.row_max[:, None] - f.log_mass[:, None])  # p_r, for rows with top_p
    mass = p.cumsum(dim=-1)
    mass_before = torch.zeros_like(mass)
    mass_before[:, 1:] = mass[:, :-1]  # exclusive prefix sums (monotone, unlike mass - p)
    needs_mass = f.top_p < 1.0
    keep = torch.arange(v.shape[1])[None, :] < f.top_k[:, None]
    keep &= ~needs_mass[:, None] | (mass_before < f.top_p[:, None])
    keep &= rel >= f.min_p[:, None]
    keep[:, 0] = True
    m = keep.sum(dim=-1)  # keep is a prefix of the ranks
    closed = (m < v.shape[1]) | (f.top_k <= v.shape[1]) | (rel[:, -1] == 0) | (needs_mass & (mass[:, -1] >= f.top_p))
    return m, rel, closed


def _bounds(row: torch.Tensor, f: _Filters) -> tuple[float, float]:
    """(tau, hi) for a row whose cut lies past its topk: its last kept token's logit lies in
    [tau, hi], unless `_boundary_cut` finds otherwise. min_p's edge is exact up to a bucket of slack;
    top_p's comes from the mass of 1/16-logit buckets below the max (one pass, no sort)."""
    # row: [V] float32; f: one row
    tau, hi = float("-inf"), float("inf")
    top_max = float(f.row_max[0])
    if float(f.min_p[0]) > 0.0:
        edge = top_max + math.log(float(f.min_p[0]))
        tau, hi = edge - 1 / BUCKETS_PER_LOGIT, edge + 1 / BUCKETS_PER_LOGIT
    if float(f.top_p[0]) < 1.0:
        bucket = ((top_max - row) * BUCKETS_PER_LOGIT).clamp_(max=NUM_BUCKETS - 1).long()  # [V], 0 = top
        mass = torch.bincount(bucket, weights=torch.exp(row - top_max), minlength=NUM_BUCKETS).double().cumsum(0)
        j = int(torch.searchsorted(mass, mass[-1:] * float(f.top_p[0]) * (1 + 1e-5)))
        if j < NUM_BUCKETS - 2:  # one bucket of slack either side of the crossing one
            low = top_max - (j + 2) / BUCKETS_PER_LOGIT
            if low > tau:
                tau, hi = low, top_max - (j - 1) / BUCKETS_PER_LOGIT
    return tau, hi


def _boundary_cut(row: torch.Tensor, tau: float, hi: float, f: _Filters) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The kept ids (ascending) and probabilities, ranking only the tokens in [tau, hi] after every
    token above hi: a sort of the few tokens near the cut, not of the kept set. None when the cut
    is not proven inside them (it lies above hi, or may run below tau)."""
    # row: [V] float32; f: one row (its top_k is off: a row with top_k is closed by its topk)
    ids = (row >= tau).nonzero()[:, 0]  # [C] ascending
    v = row[ids]  # [C]
    rel = torch.exp(v.double() - float(f.row_max[0]))  # [C] p / p_max
    above = v > hi
    near = (~above).nonzero()[:, 0]  # [N] positions in ids, ascending
    if not len(near):
        return None
    vals, order = v[near].sort(descending=True, stable=True)
    n_above = len(v) - len(near)
    ranked = rel[near[order]]  # [N] rank order
    keep = torch.arange(len(near)) + n_above < f.top_k[0]
    if float(f.top_p[0]) < 1.0:
        scale = math.exp(-float(f.log_mass[0]))  # p = rel * scale
        mass = ranked.cumsum(0) * scale
        mass_before = torch.cat([torch.zeros(1, dtype=torch.float64), mass[:-1]]) + float(rel[above].sum()) * scale
        keep &= mass_before < f.top_p[0]
    keep &= ranked >= f.min_p[0]
    if n_above == 0:
        keep[0] = True  # rank 0 always stays
    m = int(keep.sum())  # keep is a prefix of the ranks
    if m == 0 or m == len(near):  # the cut above hi, or perhaps past tau
        return None
    value, last_id = vals[m - 1], ids[near[order[m - 1]]]
    kept = (v > value) | ((v == value) & (ids <= last_id))  # ties: the lowest ids stay
    return ids[kept], rel[kept] / rel[kept].sum()


def _cut_below(row: torch.Tensor, tau: float, f: _Filters) -> tuple[torch.Tensor, torch.Tensor]:
    """The kept ids and their probabilities, ranking only the tokens with logit >= tau: whole groups
    of equal logits, so ties order exactly. If the cut is not proven inside them, the whole row."""
    # row: [V] float32; f: one row -> ids, probs: [m]
    for bound in (tau, float("-inf")):
        candidates = (row >= bound).nonzero()[:, 0]  # ascending ids
        vals, order = row[candidates].sort(descending=True, stable=True)
        m, rel, closed = _cut(vals[None], f)
        dropped_by_min_p = math.exp(bound - float(f.row_max[0])) < float(f.min_p[0])  # all below bound
        if bool(closed[0]) or dropped_by_min_p or bound == float("-inf"):
            kept = int(m[0])
            ids, by_id = candidates[order[:kept]].sort()
            return ids, (rel[0, :kept] / rel[0, :kept].sum())[by_id]
    raise AssertionError("unreachable: the whole row always closes the cut")


def _deep_cut(row: torch.Tensor, f: _Filters) -> tuple[torch.Tensor, torch.Tensor]:
    """The kept ids and probabilities of a row whose cut lies past its topk (top_p keeping tens of
    thousands of tokens on a flat row): the last kept token from a sort of the tokens near the cut
    (`_bounds`, `_boundary_cut`), else a sort of every token at or above tau (`_cut_below`). The
    C++ kernel (`ops.sampling.deep_cut`) does it in three passes where it runs; these torch ops
    are its fallback and its reference."""
    native = deep_cut(
        row, float(f.row_max[0]), float(f.log_mass[0]), int(f.top_k[0]), float(f.top_p[0]), float(f.min_p[0])
    )
    if native is not None:
        return native
    tau, hi = _bounds(row, f)
    kept = _boundary_cut(row, tau, hi, f) if tau > float("-inf") else None
    return kept if kept is not None else _cut_below(row, tau, f)


def _past_topk(params: list[SamplingParams], vocab: int, f: _Filters, k: int, block_max: torch.Tensor | None) -> bool:
    """Whether every row's cut provably lies past its first k tokens (a batch of flat rows), so
    that the topk would be run for nothing: top_k off; top_p's mass out of reach of any k tokens
    (each holds at most p_max = exp(-log_mass)); and min_p, if on, passed by k block maxima (k
    tokens). A row without a filter is not claimed. Python scalars until min_p needs the block
    maxima: a peaked row, the usual one, is turned away for a few microseconds."""
    # f: [S] rows; block_max: [S, V / BLOCK] or None
    if any(0 < p.top_k < vocab or (p.top_p >= 1.0 and p.min_p <= 0.0) for p in params):
        return False
    # a 1e-9 margin: the bound must hold whatever the rounding of the cut's own arithmetic
    if any(p.top_p < 1.0 and k * math.exp(-lm) >= p.top_p * (1 - 1e-9) for p, lm in zip(params, f.log_mass.tolist())):
        return False
    with_min = [r for r, p in enumerate(params) if p.min_p > 0.0]
    if not with_min:
        return True
    if block_max is None:
        return False
    top = f.row_max.tolist()
    edges = [top[r] + math.log(params[r].min_p) + 1e-6 for r in with_min]  # rel >= min_p above, exp's rounding included
    if len(params) == 1:  # a request alone: two tensor ops
        return int((block_max[0] >= edges[0]).sum()) >= k
    passing = block_max[with_min] if len(with_min) < len(params) else block_max
    return min((passing >= torch.tensor(edges, dtype=torch.float64)[:, None]).sum(dim=-1).tolist()) >= k


def _padded(
    n: int, kept: Kept, ids: torch.Tensor | None, probs: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """[S, W] ids and probabilities: row r's from `kept` where it has one, else from `ids`, `probs`
    [S, k] (the topk's rows); zeros past a row's own entries. One row comes back as it is."""
    if n == 1 and 0 in kept:
        i, q = kept[0]
        return i[None], q[None]
    k = ids.shape[1] if ids is not None else 0
    width = max(k, *(len(i) for i, _ in kept.values()))
    out_ids = torch.zeros(n, width, dtype=torch.long)
    out_probs = torch.zeros(n, width, dtype=torch.float64)
    if ids is not None and probs is not None:
        out_ids[:, :k], out_probs[:, :k] = ids, probs
    for r, (i, q) in kept.items():
        if k:
            out_ids[r, :k], out_probs[r, :k] = 0, 0.0
        out_ids[r, : len(i)], out_probs[r, : len(q)] = i, q
    return out_ids, out_probs


def filtered_distribution(
    logits: torch.Tensor, params: list[SamplingParams], start_k: int = START_K, stats: RowStats | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens each row keeps after top-k, top-p and min-p, and their renormalised probabilities.

    Exactly the full-sort filter: rank tokens by logit (ties by ascending id), keep rank r while
    r < top_k, the mass of the ranks before r is < top_p (the token that crosses top_p stays),
    and p_r >= min_p * p_max; rank 0 always stays. Mass is normalised by the whole row (one
    exp-and-sum pass). The ranking sees only the row's topk survivors (k = top_k, else
    `start_k`); a row whose cut may lie past them (mass still short of top_p, all passing min_p,
    or a group of equal logits running past the k-th) ranks instead every token at or above a
    threshold that provably bounds its last kept token (`_deep_cut`): one more pass finds the
    logits between which the cut lies, a sort of the tokens there finds the last kept token, and
    the kept set is every token ranked before it (ids in ascending order for such a row). When
    every row's cut provably lies past its topk (`_past_topk`: flat rows), the topk is skipped.
    """
    # logits: [S, V] float32, temperature applied -> ids: [S, K] long, probs: [S, K] float64
    # (kept ids ascending; a row's entries past those it keeps have probability 0). `stats`: `row_stats_` of these
    # rows with the normaliser of every top_p row, when the caller has them.
    ids, probs, kept = _filter_rows(logits, params, start_k, stats)
    return _padded(len(logits), kept, ids, probs) if kept else (ids, probs)


def _filter_rows(
    logits: torch.Tensor, params: list[SamplingParams], start_k: int, stats: RowStats | None
) -> tuple[torch.Tensor | None, torch.Tensor | None, Kept]:
    """`filtered_distribution` before its rows are padded into one tensor: the topk's [S, k] ids
    and probabilities (None when it was skipped), and the rows decided past the topk on their own,
    which replace those rows of the first two."""
    n, vocab = logits.shape
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float64)
    row_max, log_mass, block_max = stats if stats is not None else row_stats_(logits, None, top_p < 1.0, BLOCK)
    f = _Filters(
        torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params]),
        top_p,
        torch.tensor([p.min_p for p in params], dtype=torch.float64),
        row_max.double(),
        log_mass,
    )
    k = min(vocab, max(max(int(t) if t < vocab else start_k for t in f.top_k), 1))
    if k < vocab and _past_topk(params, vocab, f, k, block_max):
        return None, None, {r: _deep_cut(logits[r], f.rows(slice(r, r + 1))) for r in range(n)}
    vals, ids = _ranked_topk(logits, k, block_max)  # [S, k]
    m, rel, closed = _cut(vals, f)
    last = (m - 1)[:, None]
    group_inside = (vals.gather(1, last)[:, 0] > vals[:, -1]) | (rel.gather(1, last)[:, 0] == 0)
    done = (closed & group_inside) | (k >= vocab)
    probs = rel.masked_fill(torch.arange(k)[None, :] >= m[:, None], 0.0)  # [S, k]
    probs /= probs.sum(dim=-1, keepdim=True)
    ids, by_id = ids.masked_fill(probs == 0, vocab).sort(dim=-1)  # kept ids ascending, then the rest
    ids, probs = ids.clamp_(max=vocab - 1), probs.gather(1, by_id)
    kept: Kept = {}
    for r in (
        (~done).nonzero()[:, 0].tolist()
    ):  # the k-th's group of equal logits runs past it, or the cut lies past the k-th
        fr = f.rows(slice(r, r + 1))
        kept[r] = _cut_below(logits[r], float(vals[r, -1]), fr) if bool(closed[r]) else _deep_cut(logits[r], fr)
    return ids, probs, kept


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Index drawn from each row of `probs` (unnormalised, >= 0) by its uniform in [0, 1)."""
    # probs: [S, W], u: [S] -> [S] long
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1:].contiguous()
    # right=True lands on an entry with probability > 0; the rounding of u * total up to total
    # is caught by the second bound (the first entry whose cdf reaches the total).
    picks = torch.searchsorted(cdf, u.to(cdf.dtype)[:, None] * total, right=True)
    return torch.minimum(picks, torch.searchsorted(cdf, total))[:, 0]


# Tokens per block of the two-level draw over whole rows: one pass sums the blocks, the cumulative
# sum runs over the block sums and over one block only (a cumsum over 262,144 values is slow).
_DRAW_BLOCK = 1024


def _inverse_cdf_blocked(weights: torch.Tensor, u: torch.Tensor, sums: torch.Tensor | None = None) -> torch.Tensor:
    """`_inverse_cdf` over long rows, in two levels: the block the draw falls in, then the token
    within it. The same distribution (up to float32 rounding of the partial sums). `sums`: the
    weights' block sums [S, blocks] when the caller has them (`ops.sampling.exp_block_sums_`)."""
    # weights: [S, V] unnormalised, >= 0; u: [S] -> [S] long
    n, vocab = weights.shape
    blocks_n = -(-vocab // _DRAW_BLOCK)
    padded = F.pad(weights, (0, blocks_n * _DRAW_BLOCK - vocab)) if vocab % _DRAW_BLOCK else weights
    blocks = padded.view(n, blocks_n, _DRAW_BLOCK)
    if sums is None:
        sums = blocks.sum(dim=-1)  # [S, blocks]
    block = _inverse_cdf(sums, u)  # [S], a block of positive mass
    rows = torch.arange(n)
    cdf = sums.cumsum(dim=-1)
    before = torch.where(block > 0, cdf[rows, (block - 1).clamp(min=0)], torch.zeros((), dtype=cdf.dtype))
    # where the draw lands inside its block, as a fraction of the block's mass
    inner_u = ((u.to(cdf.dtype) * cdf[:, -1] - before) / sums[rows, block]).clamp_(0.0, 1.0 - 2**-24)
    return block * _DRAW_BLOCK + _inverse_cdf(blocks[rows, block], inner_u)


def _draw(logits: torch.Tensor, params: list[SamplingParams], u: torch.Tensor) -> list[int]:
    """One token per sampled row: temperature, then the filters, then an inverse-CDF draw."""
    # logits: [S, V] float32 (scaled in place), u: [S]
    n, vocab = logits.shape
    temps = [p.temperature for p in params]
    filtered = [i for i, p in enumerate(params) if _has_filter(p, vocab)]
    whole = [i for i, p in enumerate(params) if not _has_filter(p, vocab)]
    needs_mass = torch.tensor([_has_filter(p, vocab) and p.top_p < 1.0 for p in params])
    row_max, log_mass, block_max = row_stats_(
        logits, torch.tensor(temps) if any(t != 1.0 for t in temps) else None, needs_mass, BLOCK
    )
    chosen = [0] * n
    if filtered:
        rows = logits if len(filtered) == n else logits[filtered]
        sel = slice(None) if len(filtered) == n else torch.tensor(filtered)
        stats = (row_max[sel], log_mass[sel], block_max[sel] if block_max is not None else None)
        ids, probs, kept = _filter_rows(rows, [params[i] for i in filtered], START_K, stats)
        uf = u[filtered]
        # the kept tokens come in token-id order: the draw is the one over the whole row
        if ids is not None and probs is not None:
            picks = _inverse_cdf(probs, uf)
            for i, tok in zip(filtered, ids.gather(1, picks[:, None])[:, 0].tolist()):
                chosen[i] = tok
        # a row decided past its topk draws from its own tensors (tens of thousands of tokens on a
        # flat row): the same pick as from its padded row, without a fresh [S, W] pair to pad into
        for r, (row_ids, row_probs) in kept.items():
            chosen[filtered[r]] = int(row_ids[_inverse_cdf(row_probs[None], uf[r : r + 1])[0]])
    if whole:
        rows = logits if len(whole) == n else logits[whole]
        maxima = row_max if len(whole) == n else row_max[whole]
        # [W, V] weights exp(logit - max), in place (no 16 MB temporary), and their block sums: one pass
        sums = exp_block_sums_(rows, maxima, _DRAW_BLOCK)
        for i, tok in zip(whole, _inverse_cdf_blocked(rows, u[whole], sums).tolist()):
            chosen[i] = tok
    return chosen


def _logprob_of(logprobs_row: torch.Tensor, token_id: int, k: int) -> TokenLogprob:
    top: list[tuple[int, float]] = []
    if k > 0:
        values, ids = logprobs_row.topk(k)
        top = [(int(i), float(v)) for i, v in zip(ids, values)]
    return TokenLogprob(token_id, float(logprobs_row[token_id]), top)


def sample(logits: torch.Tensor, requests: list[Request]) -> SampleResult:
    """One token per request; `logits[i]` belongs to `requests[i]`.

    A float32 `logits` is edited in place (logit bias, penalties, temperature); logprobs are of the
    raw rows.
    Greedy rows take the argmax (lowest id among equal maxima) and never see a softmax."""
    # logits: [N, V]
    logits = logits.float()
    params = [r.params for r in requests]
    with_lp = [i for i, p in enumerate(params) if p.logprobs is not None]
    raw_logprobs = logits[with_lp].log_softmax(dim=-1) if with_lp else None  # [L, V]
    _add_logit_bias(logits, params)
    if any(p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty for p in params):
        _penalize(logits, requests)
    chosen = [0] * len(requests)
    greedy = [i for i, p in enumerate(params) if p.greedy]
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    if greedy:
        rows = logits if len(greedy) == len(requests) else logits[greedy]
        for i, tok in zip(greedy, rows.argmax(dim=-1).tolist()):
            chosen[i] = tok
    if sampled:
        # One uniform number per request from its own generator, in row order (seeded requests
        # are reproducible whatever else is in the batch).
        u = torch.stack([torch.rand((), generator=requests[i].generator, dtype=torch.float32) for i in sampled])
        rows = logits if len(sampled) == len(requests) else logits[sampled]
        for i, tok in zip(sampled, _draw(rows, [params[i] for i in sampled], u)):
            chosen[i] = tok
    logprobs: list[TokenLogprob | None] = [None] * len(requests)
    for row, i in enumerate(with_lp):
        assert raw_logprobs is not None
        logprobs[i] = _logprob_of(raw_logprobs[row], chosen[i], params[i].logprobs or 0)
    return SampleResult(chosen, logprobs)


def prompt_logprobs(logits: torch.Tensor, next_ids: list[int], k: int) -> list[TokenLogprob]:
    """Logprobs of each prompt token given the ones before it; row j predicts `next_ids[j]`."""
    # logits: [M, V]
    lp = logits.float().log_softmax(dim=-1)
    return [_logprob_of(lp[j], t, k) for j, t in enumerate(next_ids)]
