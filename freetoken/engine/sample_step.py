"""The sample stage of an engine step: from the step's logits to the tokens each item keeps.

Owns picking each sampling item's rows out of the step's logits (an item's last `sample_rows`
logit rows), the grammar's mask (a row it leaves no token is handed to `dead` and dropped), the
reasoning budget's forced tokens (the row is sampled as usual and the forced token replaces the
draw), the draw itself (engine/sampler.py), and for a verified chunk (engine/speculative.py) its
accepted drafts and the token after them, with a seeded generator put back where one draw per
kept token leaves it. It does not append tokens to requests or end them: the engine does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from freetoken.engine.grammar import GrammarSet
from freetoken.engine.sampler import SampleResult, prompt_logprobs, sample
from freetoken.engine.scheduler import ScheduledItem
from freetoken.engine.speculative import accepted, rewind
from freetoken.request import Request, TokenLogprob

# Per sampling item, the tokens it keeps and their logprobs (a verified chunk keeps its accepted
# drafts and the token after them).
Kept = tuple[ScheduledItem, list[int], list[TokenLogprob | None]]


@torch.inference_mode()  # the logits are the runner's inference tensors, masked and sampled in place
def sample_step(
    items: list[ScheduledItem], logits: torch.Tensor, grammars: GrammarSet, dead: Callable[[Request], None]
) -> list[Kept]:
    """The tokens each sampling item of the step keeps, in item order."""
    sampling: list[ScheduledItem] = []  # one entry per sampling row (a verified chunk: 1 + k)
    rows: list[int] = []
    end = 0
    for item in items:
        end += item.logit_rows
        if item.sample_rows:
            sampling.extend([item] * item.sample_rows)
            rows.extend(range(end - item.sample_rows, end))
    if not sampling:
        return []
    states = _generator_states(items)  # before the sampler draws one uniform per row
    chosen = _rows_of(logits, rows)  # [S, V]; logits is not read again
    masked_out = set(grammars.mask(chosen, [it.req.rid for it in sampling]))
    for i in sorted(masked_out):
        dead(sampling[i].req)
    if masked_out:
        keep = [i for i in range(len(sampling)) if i not in masked_out]
        sampling, chosen = [sampling[i] for i in keep], chosen[keep]
    if not sampling:
        return []
    forced = _forced_tokens(chosen, sampling)  # before `sample` edits the rows in place
    result = sample(chosen, [it.req for it in sampling])
    for i, tok, lp in forced:
        result.token_ids[i], result.logprobs[i] = tok, lp
    kept = list(_verified(sampling, result))
    for item, toks, _ in kept:
        state = states.get(item.req.rid)
        if state is not None and item.req.generator is not None:
            rewind(item.req.generator, state, len(toks))
    return kept


def _rows_of(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """logits[rows] for increasing rows: a view when they are consecutive (every row of a decode
    step samples), else a copy. At 16 rows of a 262144-word vocabulary the copy is 16 MB a step."""
    if rows[-1] - rows[0] == len(rows) - 1:
        return logits[rows[0] : rows[-1] + 1]
    return logits[rows]


def _forced_tokens(rows: torch.Tensor, sampling: list[ScheduledItem]) -> list[tuple[int, int, TokenLogprob | None]]:
    """(row, token, logprob) of each row whose reasoning budget forces its token: the row is
    sampled as usual (a seeded generator draws as always) and the forced token replaces the draw,
    with its logprob under the model's distribution. A row with a draft is never forced (the
    speculator keeps drafts within `ReasoningState.free_tokens`)."""
    # rows: [S, V], the raw logits (grammar-masked) of the sampling rows
    out: list[tuple[int, int, TokenLogprob | None]] = []
    for i, item in enumerate(sampling):
        state = item.req.reasoning
        tok = state.forced() if state is not None else None
        if tok is not None:
            k = item.req.params.logprobs
            out.append((i, tok, None if k is None else prompt_logprobs(rows[i : i + 1], [tok], k)[0]))
    return out


def _generator_states(items: list[ScheduledItem]) -> dict[str, torch.Tensor]:
    """The generator state of each seeded, sampled request with a verified chunk, before the
    sampler draws one uniform per row of it."""
    return {
        it.req.rid: it.req.generator.get_state()
        for it in items
        if it.draft and it.req.generator is not None and not it.req.params.greedy
    }


def _verified(sampling: list[ScheduledItem], result: SampleResult) -> Iterator[Kept]:
    """Per sampling item, the tokens it keeps: one per plain row; a verified chunk's 1 + k rows
    (consecutive in `sampling`) give its accepted drafts and the token drawn after them."""
    i = 0
    while i < len(sampling):
        item = sampling[i]
        if not item.draft:
            yield item, result.token_ids[i : i + 1], result.logprobs[i : i + 1]
            i += 1
            continue
        toks = result.token_ids[i : i + item.n]
        kept = accepted(item.draft, toks) + 1
        yield item, toks[:kept], result.logprobs[i : i + kept]
        i += item.n
