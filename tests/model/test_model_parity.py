"""Logits parity with transformers (eager attention) on tiny random-weight models of each family,
loaded through the real safetensors path, for prefill, paged decode, mixed batches and released
SWA pages."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from model_harness import PagedRunner, Seq, load_freetoken, make_reference, reference_logits

FAMILIES = ["llama", "gemma3", "gpt_oss"]
L = 19  # prompt length: longer than every window (5 and 6)
TOL = {torch.float32: 1e-4, torch.float64: 1e-6}


@pytest.fixture(scope="module", params=FAMILIES)
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict:
    directory = tmp_path_factory.mktemp(request.param)
    reference = make_reference(request.param, Path(directory))
    ids = random.Random(7).choices(range(reference.config.vocab_size), k=L)
    return {
        "name": request.param,
        "dir": Path(directory),
        "ids": ids,
        "ref": {dt: reference_logits(reference, ids, dt) for dt in TOL},
        "models": {},
    }


def model_of(family: dict, dtype: torch.dtype):
    if dtype not in family["models"]:
        family["models"][dtype] = load_freetoken(family["dir"], dtype)
    return family["models"][dtype]


def assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == want.dtype
    torch.testing.assert_close(got, want, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("page_size", [1, 4])
def test_prefill_all_logits(family: dict, dtype: torch.dtype, page_size: int) -> None:
    runner = PagedRunner(model_of(family, dtype), page_size, dtype)
    (logits,) = runner.step([(Seq(), family["ids"])], all_logits=True)
    assert logits.shape == (L, 300)
    assert_close(logits, family["ref"][dtype], dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("page_size", [1, 4])
def test_decode_token_by_token(family: dict, dtype: torch.dtype, page_size: int) -> None:
    runner = PagedRunner(model_of(family, dtype), page_size, dtype)
    seq, ids = Seq(), family["ids"]
    (first,) = runner.step([(seq, ids[:3])])  # a short prefill, then one token per step
    rows = [first]
    for t in range(3, L):
        rows.extend(runner.step([(seq, [ids[t]])]))
    assert_close(torch.cat(rows), family["ref"][dtype][2:], dtype)
    assert runner.kv.null_pages_are_zero()


@pytest.mark.parametrize("page_size", [1, 4])
def test_released_swa_pages_do_not_change_results(family: dict, page_size: int) -> None:
    """Out-of-window SWA entries set to NULL and their pages poisoned with NaN and reused:
    decode still matches the reference."""
    dtype = torch.float64
    runner = PagedRunner(model_of(family, dtype), page_size, dtype, pages=40)
    seq, ids = Seq(), family["ids"]
    rows = runner.step([(seq, ids[:8])])
    runner.release_out_of_window(seq, poison=True)
    for t in range(8, L):
        rows.extend(runner.step([(seq, [ids[t]])]))
        runner.release_out_of_window(seq, poison=True)
    if runner.config.has_swa:
        assert 0 in seq.swa  # pages really were released
    assert_close(torch.cat(rows), family["ref"][dtype][7:], dtype)
    assert runner.kv.null_pages_are_zero()


def test_mixed_batch_equals_running_alone(family: dict) -> None:
    """One request prefilling a chunk beside one decoding, in one step, equals each alone."""
    dtype = torch.float64
    model = model_of(family, dtype)
    ids = family["ids"]
    other = list(reversed(ids))

    def run(together: bool) -> tuple[torch.Tensor, torch.Tensor]:
        runner = PagedRunner(model, 4, dtype)
        a, b = Seq(), Seq()
        runner.step([(a, ids[:6])])  # A: first prefill chunk
        runner.step([(b, other[:9])])  # B: its prompt; it decodes next
        if together:
            la, lb = runner.step([(a, ids[6:15]), (b, other[9:10])], all_logits=True)
        else:
            (la,) = runner.step([(a, ids[6:15])], all_logits=True)
            (lb,) = runner.step([(b, other[9:10])], all_logits=True)
        return la, lb

    (la, lb), (ra, rb) = run(True), run(False)
    torch.testing.assert_close(la, ra, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(lb, rb, atol=1e-12, rtol=1e-12)
    assert_close(la, family["ref"][dtype][6:15], dtype)


def test_bfloat16_runs_close_to_float32(family: dict) -> None:
    """bfloat16 weights and K/V: same argmax-level behaviour, loosely close logits."""
    dtype = torch.bfloat16
    runner = PagedRunner(load_freetoken(family["dir"], dtype), 4, dtype)
    seq, ids = Seq(), family["ids"]
    rows = runner.step([(seq, ids[:10])])
    for t in range(10, L):
        rows.extend(runner.step([(seq, [ids[t]])]))
    got, want = torch.cat(rows), family["ref"][torch.float32][9:]
    assert got.dtype == torch.float32
    err = (got - want).abs().max().item()
    assert err < 0.05 * want.abs().max().item(), err
