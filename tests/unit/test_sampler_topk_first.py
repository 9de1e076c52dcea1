"""The top-k-first sampler against the full-sort filter it replaces, on random logits.

A small reference implementation of the old filter (sort the whole row, softmax, cut) lives here,
in float64 and with a stable sort (equal logits ranked by ascending id, the rule the sampler
documents). Where a cut sits within a relative 1e-5 of top_p or min_p (float32 rounding decides
such knife edges, in the old filter as in the new), either side of the edge is accepted.

A row whose cut lies past its topk takes the deep cut, in the C++ kernel where it is built
(`ops.sampling.deep_cut`) and in torch ops otherwise: the tests that reach it run both paths
(`deep_cut_path`), each against the reference, and the two against each other.
"""

from __future__ import annotations

import contextlib
import math
import random
from collections.abc import Iterator
from unittest import mock

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from freetoken.engine import sampler
from freetoken.engine.sampler import _inverse_cdf, _penalize, filtered_distribution, sample
from freetoken.ops import sampling
from freetoken.request import Request, SamplingParams

TOL = 1e-5
PATHS = [
    pytest.param("native", marks=pytest.mark.skipif(sampling._KERNEL is None, reason="C++ sampler passes not built")),
    "torch",
]


@contextlib.contextmanager
def deep_cut_path(path: str) -> Iterator[dict[str, int]]:
    """The sampler's deep cut through the kernel ("native") or its torch ops ("torch"). Yields a
    count of the rows the kernel decided, so that a test can show it ran (a kernel declining every
    row would otherwise pass for the torch path twice)."""
    decided = {"rows": 0}
    kernel = sampler.deep_cut

    def counted(*args):
        out = kernel(*args)
        decided["rows"] += out is not None
        return out

    with mock.patch.object(sampler, "deep_cut", counted if path == "native" else (lambda *args: None)):
        yield decided


def reference_cut(row: torch.Tensor, top_k: int, top_p: float, min_p: float) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The full-sort filter: (logits by rank, ids by rank, how many ranks it keeps)."""
    vals, order = row.double().sort(descending=True, stable=True)
    probs = vals.softmax(dim=-1)
    vocab = len(row)
    mass_before = torch.cat([torch.zeros(1, dtype=torch.float64), probs.cumsum(dim=-1)[:-1]])
    drop = torch.arange(vocab) >= (top_k if 0 < top_k < vocab else vocab)
    drop |= mass_before >= top_p
    drop |= probs < min_p * probs[0]
    drop[0] = False
    return vals, order, int((~drop).sum())


def support(ids: torch.Tensor, probs: torch.Tensor) -> dict[int, float]:
    return {int(i): float(q) for i, q in zip(ids, probs) if q > 0}


def positive(ids: torch.Tensor, probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The (ids, probabilities) of the tokens with probability > 0, by ascending id."""
    keep = probs > 0
    ids, by_id = ids[keep].sort()
    return ids, probs[keep][by_id]


def assert_full_sort_row(row: torch.Tensor, p: SamplingParams, ids: torch.Tensor, probs: torch.Tensor) -> None:
    """One row's kept tokens (probability > 0, ascending ids) and probabilities are the full sort's,
    with either side of a knife edge within TOL accepted."""
    got_ids, got_probs = positive(ids, probs)
    assert bool((ids[probs > 0].diff() > 0).all()), "kept ids not ascending"
    vals, order, lo = reference_cut(row, p.top_k, p.top_p * (1 - TOL), min(1.0, p.min_p * (1 + TOL)))
    _, _, hi = reference_cut(row, p.top_k, p.top_p * (1 + TOL), p.min_p * (1 - TOL))
    for m in range(lo, hi + 1):
        want_ids, want_probs = positive(order[:m], vals[:m].softmax(dim=-1))
        if torch.equal(got_ids, want_ids):
            torch.testing.assert_close(got_probs, want_probs, rtol=1e-9, atol=1e-12)
            return
    raise AssertionError(f"{p}: kept {len(got_ids)} tokens {got_ids[:8].tolist()}..., the full sort keeps {lo}-{hi}")


def assert_full_sort_distribution(logits: torch.Tensor, params: list[SamplingParams], start_k: int) -> None:
    ids, probs = filtered_distribution(logits.clone(), params, start_k=start_k)
    for r, p in enumerate(params):
        assert_full_sort_row(logits[r], p, ids[r], probs[r])


def filters(vocab: int) -> st.SearchStrategy[SamplingParams]:
    return st.builds(
        SamplingParams,
        top_k=st.sampled_from([0, -1, 1, 2, 3, 5, max(vocab - 1, 1), vocab, vocab + 7]),
        top_p=st.one_of(st.just(1.0), st.floats(0.01, 1.0)),
        min_p=st.one_of(st.just(0.0), st.floats(0.0, 1.0)),
    )


VALUES = {
    "floats": st.floats(-30.0, 30.0, width=32),
    "ties": st.integers(-2, 2).map(float),  # many equal logits: the cut runs through tie groups
    "masked": st.sampled_from([float("-inf"), 0.0, 1.0, 1.0, 2.5]),  # grammar-masked rows
}


def seeded_rows(kind: str, rows: int, vocab: int, seed: int) -> torch.Tensor:
    """[rows, vocab] float32 of one VALUES kind from a seed: long rows drawn element by element
    cost hypothesis seconds each (the test took ~40 s a path on a Zen 3 that way)."""
    g = torch.Generator().manual_seed(seed)
    if kind == "floats":
        return torch.rand(rows, vocab, generator=g) * 60 - 30
    if kind == "ties":
        return torch.randint(-2, 3, (rows, vocab), generator=g).float()
    choices = torch.tensor([float("-inf"), 0.0, 1.0, 1.0, 2.5])
    return choices[torch.randint(0, len(choices), (rows, vocab), generator=g)]


@st.composite
def batches(draw: st.DrawFn) -> tuple[torch.Tensor, list[SamplingParams], int]:
    # short rows, drawn value by value (hypothesis reaches the edges: -30, 30, -0.0, ...), and rows
    # of 4-16 blocks of 64 from a drawn seed (topk through the blocks' maxima for small k)
    vocab = draw(st.one_of(st.integers(1, 48), st.sampled_from([256, 640, 1024])))
    kind = draw(st.sampled_from(sorted(VALUES)))
    rows = draw(st.integers(1, 4))
    if vocab <= 48:
        values = draw(st.lists(st.lists(VALUES[kind], min_size=vocab, max_size=vocab), min_size=rows, max_size=rows))
        logits = torch.tensor(values, dtype=torch.float32)
    else:
        logits = seeded_rows(kind, rows, vocab, draw(st.integers(0, 2**32 - 1)))
    assume(bool(torch.isfinite(logits).any(dim=1).all()))
    params = draw(st.lists(filters(vocab), min_size=rows, max_size=rows))
    return logits, params, draw(st.sampled_from([1, 2, 3, 256]))


@pytest.mark.parametrize("path", PATHS)
@settings(max_examples=400, deadline=None)
@given(batch=batches())
def test_top_k_first_is_the_full_sort_filter(path: str, batch: tuple[torch.Tensor, list[SamplingParams], int]) -> None:
    logits, params, start_k = batch
    with deep_cut_path(path):
        assert_full_sort_distribution(logits, params, start_k)


@pytest.mark.parametrize("path", PATHS)
def test_deep_cuts_and_tie_groups_past_the_first_topk(path: str) -> None:
    g = torch.Generator().manual_seed(0)
    vocab = 8192  # 128 blocks of 64
    flat = torch.randn(3, vocab, generator=g)  # top_p 0.9 keeps thousands of tokens: past any topk
    ties = (torch.randn(3, vocab, generator=g) * 4).bfloat16().float()  # bf16 rounding: tie groups
    with deep_cut_path(path) as decided:
        for logits in (flat, ties):
            for params in [
                SamplingParams(top_p=0.9),
                SamplingParams(top_p=0.999),
                SamplingParams(min_p=0.05),
                SamplingParams(min_p=0.3, top_p=0.95),
                SamplingParams(top_k=40),
                SamplingParams(top_k=40, top_p=0.5, min_p=0.01),
                SamplingParams(top_k=vocab * 2, top_p=0.7),
            ]:
                for start_k in (4, 256):
                    assert_full_sort_distribution(logits, [params, SamplingParams(top_k=3), params], start_k)
    assert path == "torch" or decided["rows"] >= 20


def flat_rows(vocab: int, seed: int) -> torch.Tensor:
    """[3, V]: a random-weight model's row (flat: top_p 0.95 keeps ~90% of it), a wider one, and
    one rounded to bfloat16 as a model emits it (long runs of equal logits)."""
    g = torch.Generator().manual_seed(seed)
    return torch.stack([
        torch.randn(vocab, generator=g) * 0.4,
        torch.randn(vocab, generator=g) * 2.5,
        (torch.randn(vocab, generator=g) * 3).bfloat16().float(),
    ])


DEEP_PARAMS = [
    SamplingParams(top_p=0.95),
    SamplingParams(top_p=0.5),
    SamplingParams(min_p=0.05),
    SamplingParams(top_p=0.95, min_p=0.01),
    SamplingParams(top_p=0.9, min_p=0.3),
]


@pytest.mark.parametrize("vocab", [49_152, 262_144])
@pytest.mark.parametrize("path", PATHS)
def test_flat_rows_at_real_vocabularies(path: str, vocab: int) -> None:
    """SmolLM2's and Gemma's vocabularies, flat rows whose cut lies thousands of tokens past any
    topk: the batch, and each row alone (a batch of one comes back as the deep cut returned it)."""
    rows = flat_rows(vocab, seed=vocab)
    with deep_cut_path(path) as decided:
        for p in DEEP_PARAMS:
            ids, probs = filtered_distribution(rows.clone(), [p] * len(rows))
            for r in range(len(rows)):
                assert_full_sort_row(rows[r], p, ids[r], probs[r])
            ids, probs = filtered_distribution(rows[:1].clone(), [p])
            assert_full_sort_row(rows[0], p, ids[0], probs[0])
    assert path == "torch" or decided["rows"] >= 12  # 14: the rest cut inside their topk


@pytest.mark.parametrize("vocab", [4_096, 49_152])
@pytest.mark.parametrize("path", PATHS)
def test_a_tie_group_straddling_a_deep_cut_keeps_its_lowest_ids(path: str, vocab: int) -> None:
    """Rows of three logit values at random positions: the cut falls inside a group of thousands of
    equal logits, past any topk, and keeps that group's lowest ids, whatever else the row holds."""
    g = torch.Generator().manual_seed(vocab)
    level = torch.multinomial(torch.tensor([0.3, 0.3, 0.4]), vocab, replacement=True, generator=g)
    row = torch.tensor([2.0, 1.0, -1.0])[level]  # [V]
    mass = (row.double() - 2).exp()
    mass /= mass.sum()
    top, middle = (level == 0).nonzero()[:, 0], (level == 1).nonzero()[:, 0]  # ids ascending
    p_top, p_middle = float(mass[top[0]]), float(mass[middle[0]])
    cases = [  # (params, the ids the full sort keeps)
        (SamplingParams(top_p=0.5), top[: math.ceil(0.5 / p_top)]),  # the crossing token stays
        (SamplingParams(top_p=0.4, min_p=0.3), top[: math.ceil(0.4 / p_top)]),
        (SamplingParams(top_p=0.9), None),  # into the middle group
        (SamplingParams(min_p=0.3), torch.cat([top, middle]).sort().values),  # e^-1 >= 0.3 > e^-3
    ]
    head = float(mass[top].sum())
    middle_kept = math.ceil((0.9 - head) / p_middle)
    cases[2] = (cases[2][0], torch.cat([top, middle[:middle_kept]]).sort().values)
    assert len(top) > 1000 and 0 < middle_kept < len(middle)
    with deep_cut_path(path) as decided:
        for params, want in cases:
            ids, probs = filtered_distribution(row[None].clone(), [params])
            got, _ = positive(ids[0], probs[0])
            assert torch.equal(got, want), (params, len(got), len(want))
            assert_full_sort_row(row, params, ids[0], probs[0])
    assert path == "torch" or decided["rows"] == len(cases)


def awkward_rows(vocab: int, seed: int) -> dict[str, torch.Tensor]:
    """Rows a deep cut must get right beyond the flat ones: whole-number logits (a few huge tie
    groups), a grammar mask (-inf on 70% of the row), logits spread past 64 below the max (the
    kernel's last bucket), one token far above a flat rest, and every logit equal."""
    g = torch.Generator().manual_seed(seed)
    masked = torch.randn(vocab, generator=g)
    masked[torch.rand(vocab, generator=g) < 0.7] = float("-inf")
    spike = torch.randn(vocab, generator=g) * 0.3
    spike[vocab // 3] = 30.0
    return {
        "integers": torch.randint(-3, 3, (vocab,), generator=g).float(),
        "masked": masked,
        "spread": torch.randn(vocab, generator=g) * 40,
        "spike": spike,
        "equal": torch.zeros(vocab),
    }


def one_row_filters(row: torch.Tensor, top_p: float, min_p: float) -> sampler._Filters:
    top = row.max().double()
    return sampler._Filters(
        torch.tensor([len(row)]),
        torch.tensor([top_p], dtype=torch.float64),
        torch.tensor([min_p], dtype=torch.float64),
        top[None],
        torch.logsumexp(row.double() - top, 0)[None],
    )


@pytest.mark.skipif(sampling._KERNEL is None, reason="C++ sampler passes not built")
@pytest.mark.parametrize("vocab", [4_097, 49_152, 262_144])
def test_the_kernel_deep_cut_is_the_torch_deep_cut(vocab: int) -> None:
    """Row for row, the kernel's kept ids equal the torch path's and its probabilities agree to
    float64 rounding (relative 1e-12), on its AVX-512 path and its plain one; 4,097 leaves a short
    last vector."""
    rows = dict(zip(("flat", "wide", "bf16"), flat_rows(vocab, seed=vocab + 1)))
    rows.update(awkward_rows(vocab, seed=vocab))
    settings_ = [(0.95, 0.0), (0.5, 0.0), (0.999, 0.0), (1.0, 0.05), (0.95, 0.01), (0.9, 0.3), (1.0, 1e-300)]
    if vocab > 100_000:  # the big rows: the flat ones and their usual settings
        rows, settings_ = {k: rows[k] for k in ("flat", "bf16", "integers")}, settings_[:5]
    for name, row in rows.items():
        for top_p, min_p in settings_:
            f = one_row_filters(row, top_p, min_p)
            with deep_cut_path("torch"):
                want_ids, want_probs = sampler._deep_cut(row, f)
            for simd in (True, False):
                ids, probs = sampling._KERNEL.deep_cut(row, float(f.row_max[0]), float(f.log_mass[0]), vocab, top_p, min_p, simd)
                assert torch.equal(ids, want_ids), (name, top_p, min_p, simd, len(ids), len(want_ids))
                torch.testing.assert_close(probs, want_probs, rtol=1e-12, atol=0)


@pytest.mark.parametrize("path", PATHS)
def test_a_batch_of_flat_rows_skips_the_topk(path: str) -> None:
    """When no k tokens of any row can hold its top_p mass (and min_p, if on, passes k block maxima)
    every row goes straight to the deep cut; one row that may cut inside its topk sends the batch
    through the topk as before. Either way the full sort's tokens."""
    rows = flat_rows(8192, seed=5)[:1].repeat(2, 1)
    peaked = rows[0].clone()
    peaked[:32] += 15.0
    ranked = sampler._ranked_topk
    for params, batch, skips in [
        ([SamplingParams(top_p=0.95)] * 2, rows, True),
        ([SamplingParams(min_p=0.05), SamplingParams(top_p=0.9, min_p=0.01)], rows, True),
        ([SamplingParams(min_p=0.05)], rows[:1], True),
        ([SamplingParams(min_p=0.05), SamplingParams(top_p=0.9)], rows, True),
        ([SamplingParams(min_p=0.9)], rows[:1], False),
        ([SamplingParams(min_p=0.9)] * 2, rows, False),  # min_p 0.9 keeps a few tokens
        ([SamplingParams(top_p=0.95)] * 2, torch.stack([rows[0], peaked]), False),
        ([SamplingParams(top_p=0.95), SamplingParams(top_p=0.95, top_k=4000)], rows, False),
    ]:
        with deep_cut_path(path), mock.patch.object(sampler, "_ranked_topk", side_effect=ranked) as topk:
            ids, probs = filtered_distribution(batch.clone(), params)
        assert topk.called != skips, params
        for r, p in enumerate(params):
            assert_full_sort_row(batch[r], p, ids[r], probs[r])


def test_a_cut_through_equal_logits_keeps_the_lowest_ids() -> None:
    logits = torch.tensor([[1.0, 5.0, 3.0, 3.0, 3.0, 3.0, 0.0]])
    for start_k in (1, 2, 256):
        ids, probs = filtered_distribution(logits.clone(), [SamplingParams(top_k=3)], start_k=start_k)
        assert set(support(ids[0], probs[0])) == {1, 2, 3}
    # uniform over 4 equal tokens, top_p 0.6: the first two reach 0.5 < 0.6, the third crosses it
    ids, probs = filtered_distribution(torch.zeros(1, 4), [SamplingParams(top_p=0.6)], start_k=1)
    assert support(ids[0], probs[0]) == {0: 1 / 3, 1: 1 / 3, 2: 1 / 3}


def test_top_k_past_the_vocabulary_and_min_p_alone() -> None:
    logits = torch.tensor([[0.0, 1.0, 3.0, 2.0, -1.0]])
    ids, probs = filtered_distribution(logits.clone(), [SamplingParams(top_k=100)])
    kept = support(ids[0], probs[0])
    assert torch.allclose(torch.tensor([kept[t] for t in range(5)], dtype=torch.float64), logits[0].double().softmax(-1))
    ids, probs = filtered_distribution(logits.clone(), [SamplingParams(min_p=math.exp(-1.5))])
    assert set(support(ids[0], probs[0])) == {2, 3}  # p_1 / p_max = e^-2 < e^-1.5 <= e^-1


def req(params: SamplingParams, prompt=(1, 2), output=(), seed: int | None = None) -> Request:
    r = Request("r", list(prompt), params, output_ids=list(output))
    if seed is not None:
        r.generator = torch.Generator().manual_seed(seed)
    return r


def test_draws_follow_the_filtered_distribution() -> None:
    logits = torch.tensor([0.0, 1.0, 3.0, 2.0, -1.0, 2.5])
    params = SamplingParams(temperature=0.7, top_p=0.95, min_p=0.02)
    n = 20000
    r = req(params, seed=7)  # the same request on every row: 20000 draws from one generator
    tokens = sample(logits.repeat(n, 1), [r] * n).token_ids
    vals, order, m = reference_cut(logits / 0.7, 0, 0.95, 0.02)
    expected = support(order[:m], vals[:m].softmax(dim=-1))
    assert set(tokens) == set(expected)
    chi2 = sum((tokens.count(t) - n * q) ** 2 / (n * q) for t, q in expected.items())
    assert chi2 < 25.0, chi2  # df <= 5; 25 is beyond the 0.9999 quantile


@pytest.mark.parametrize("path", PATHS)
def test_a_row_decided_past_its_topk_draws_what_its_padded_row_draws(path: str) -> None:
    """`sample` draws a deep row from its own kept tensors, not from the padded batch
    `filtered_distribution` returns: for the same uniform numbers, the same tokens. A batch of flat
    rows (the topk skipped) and one mixing them with a peaked row and a top_k row."""
    flat = flat_rows(8192, seed=9)
    peaked = flat[0].clone()
    peaked[:32] += 15.0
    for logits, params in [
        (flat, [SamplingParams(temperature=0.8, top_p=0.95), SamplingParams(min_p=0.05), SamplingParams(top_p=0.99)]),
        (
            torch.stack([flat[0], peaked, flat[2]]),
            [SamplingParams(top_p=0.9), SamplingParams(top_p=0.9), SamplingParams(top_k=50, temperature=1.5)],
        ),
    ]:
        for seed in range(5):
            reqs = [req(p, seed=seed * 10 + i) for i, p in enumerate(params)]
            with deep_cut_path(path):
                got = sample(logits.clone(), reqs).token_ids
                u = torch.stack([torch.rand((), generator=torch.Generator().manual_seed(seed * 10 + i)) for i in range(3)])
                scaled = logits / torch.tensor([p.temperature for p in params])[:, None]
                ids, probs = filtered_distribution(scaled, params)
            assert got == ids.gather(1, _inverse_cdf(probs, u)[:, None])[:, 0].tolist()


def test_greedy_rows_ignore_sampled_neighbours() -> None:
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 3000, generator=g) * 3
    reqs = [
        req(SamplingParams(temperature=0, logprobs=3)),
        req(SamplingParams(temperature=0.5, top_p=0.9, repetition_penalty=1.3), prompt=range(50)),
        req(SamplingParams(temperature=0, presence_penalty=1.0), output=(5, 6)),
        req(SamplingParams(temperature=2.0, min_p=0.1, top_k=20), seed=3),
    ]
    out = sample(logits.clone(), reqs)
    for i in (0, 2):
        alone = sample(logits[i : i + 1].clone(), [reqs[i]])
        assert out.token_ids[i] == alone.token_ids[0]
    assert out.token_ids[0] == int(logits[0].argmax())
    lp = out.logprobs[0]
    assert lp is not None and math.isclose(lp.logprob, float(logits[0].log_softmax(-1).max()), rel_tol=1e-6)
    assert [t for t, _ in lp.top] == logits[0].topk(3).indices.tolist()


def test_seeded_filtered_requests_repeat_whatever_the_batch() -> None:
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=50)
    steps = [torch.randn(3000, generator=torch.Generator().manual_seed(i)) * 2 for i in range(6)]
    alone, mine = [], req(params, seed=11)
    for row in steps:
        alone.append(sample(row[None].clone(), [mine]).token_ids[0])
    batched, mine = [], req(params, seed=11)
    for row in steps:
        neighbours = [req(SamplingParams(top_p=0.99)), req(SamplingParams(temperature=0)), req(SamplingParams(min_p=0.2), seed=1)]
        logits = torch.stack([torch.randn(3000) * 0.5, row, torch.randn(3000), torch.randn(3000) * 4])
        batched.append(sample(logits, [neighbours[0], mine, *neighbours[1:]]).token_ids[1])
    assert batched == alone


def old_penalize(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """The per-row loop the batched penalties replace."""
    out = logits
    for i, r in enumerate(requests):
        p = r.params
        if p.repetition_penalty != 1.0 and r.all_ids:
            seen = torch.tensor(sorted(set(r.all_ids)), dtype=torch.long)
            row = out[i, seen]
            out[i, seen] = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
        if (p.frequency_penalty or p.presence_penalty) and r.output_ids:
            ids = torch.tensor(r.output_ids, dtype=torch.long)
            counts = torch.zeros(out.shape[1], dtype=out.dtype).scatter_add_(0, ids, torch.ones_like(ids, dtype=out.dtype))
            out[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(out.dtype)
    return out


def test_batched_penalties_match_the_per_row_loop() -> None:
    rng = random.Random(0)
    for case in range(60):
        vocab = rng.choice([7, 50, 300])
        reqs = []
        for _ in range(rng.randint(1, 6)):
            params = SamplingParams(
                repetition_penalty=rng.choice([1.0, 1.0, 0.5, 1.3, 2.0, 10.0]),
                frequency_penalty=rng.choice([0.0, 0.0, -1.5, 0.3, 2.0]),
                presence_penalty=rng.choice([0.0, 0.0, -0.7, 0.5, 2.0]),
            )
            prompt = [rng.randrange(vocab) for _ in range(rng.randint(0, 40))]
            output = [rng.randrange(vocab) for _ in range(rng.randint(0, 25))]
            reqs.append(req(params, prompt=prompt, output=output))
        logits = torch.randn(len(reqs), vocab, generator=torch.Generator().manual_seed(case)) * 4
        assert torch.equal(_penalize(logits.clone(), reqs), old_penalize(logits.clone(), reqs)), case


def test_two_level_draw_picks_what_the_whole_row_cdf_picks() -> None:
    """The blocked inverse CDF over whole rows (temperature-only requests) lands on the token a
    single cumulative sum over the row would, for the same uniform number: the same
    distribution. Rows span several blocks, with a padded last block and zero-mass blocks."""
    from freetoken.engine.sampler import _DRAW_BLOCK, _inverse_cdf, _inverse_cdf_blocked
    from freetoken.ops.sampling import exp_block_sums_

    gen = torch.Generator().manual_seed(7)
    vocab = 3 * _DRAW_BLOCK + 123
    logits = torch.randn(4, vocab, generator=gen) * 3
    logits[1, _DRAW_BLOCK : 2 * _DRAW_BLOCK] = float("-inf")  # a block with no mass
    logits[2, :-5] = float("-inf")  # all mass in the padded last block
    weights = (logits - logits.amax(dim=-1, keepdim=True)).exp()
    # the sampler's own path: weights in place and their block sums from one pass (ops.sampling)
    kernel_weights = logits.clone()
    sums = exp_block_sums_(kernel_weights, logits.amax(dim=-1), _DRAW_BLOCK)
    u = torch.rand(4, 2000, generator=gen)
    mismatches = kernel_mismatches = 0
    for j in range(u.shape[1]):
        got = _inverse_cdf_blocked(weights, u[:, j])
        want = _inverse_cdf(weights.double(), u[:, j].double())
        assert bool((weights[torch.arange(4), got] > 0).all())  # never a zero-probability token
        mismatches += int((got != want).sum())
        got = _inverse_cdf_blocked(kernel_weights, u[:, j], sums)
        assert bool((weights[torch.arange(4), got] > 0).all())
        kernel_mismatches += int((got != want).sum())
    assert mismatches <= 8  # float32 partial sums may move a draw that falls on a boundary
    assert kernel_mismatches <= 8


def test_the_boundary_sort_keeps_what_sorting_the_whole_row_keeps() -> None:
    """A deep row's kept set comes from a sort of the tokens near its cut (`_boundary_cut`), not of
    the whole kept set; it must be the set a sort of the whole row gives, tie groups included."""
    from freetoken.engine.sampler import _Filters, _boundary_cut, _bounds, _cut_below

    g = torch.Generator().manual_seed(3)
    used = 0
    for scale, bf16 in ((2.0, False), (2.5, True), (0.3, True)):
        for _ in range(4):
            row = torch.randn(20000, generator=g) * scale
            row = row.bfloat16().float() if bf16 else row  # bf16: long runs of equal logits
            for top_p, min_p in ((0.9, 0.0), (0.95, 0.0), (0.999, 0.0), (1.0, 0.05), (0.95, 0.01), (0.5, 0.3)):
                top = row.max().double()
                f = _Filters(torch.tensor([len(row)]), torch.tensor([top_p], dtype=torch.float64),
                             torch.tensor([min_p], dtype=torch.float64), top[None],
                             torch.logsumexp(row.double() - top, 0)[None])
                tau, hi = _bounds(row, f)
                got = _boundary_cut(row, tau, hi, f)
                want_ids, want_probs = _cut_below(row, float("-inf"), f)
                if got is None:
                    continue
                used += 1
                assert torch.equal(got[0], want_ids), (scale, top_p, min_p)
                assert torch.allclose(got[1], want_probs, rtol=1e-9, atol=0)
    assert used >= 60  # the boundary sort, not the fallback, decides nearly every such row
