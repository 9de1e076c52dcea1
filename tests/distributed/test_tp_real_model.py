"""One rank against several over gloo on the bundled models is the same model: Gemma 3 270M
Q4_K_M at TP=2 (one KV head, replicated on both ranks; vocabulary 262144 split in two) and
SmolLM2-135M Q4_1 at TP=3 (its 3 KV heads split). Over several prompts (two sharing a prefix)
prefilled in one batch and decoded greedily together, the top-5 log-probabilities at every
prefill and decode position agree within TOL and the greedy texts are equal: Gemma with the
file's quantized weights (the serving default `--weights auto`) over 32 tokens with float and
8-bit K/V, and with float weights over 16; SmolLM2 over 16 tokens with 8-bit K/V.

TOL: float weights combine the ranks' partial sums with an all-reduce, which differs from the
unsplit sum by float32 rounding (measured: at most 4e-5 over these rows). Quantized weights
gather instead (models/shard.py, ROW_GATHER) and are equal bit for bit (measured: 0); with an
all-reduce there Gemma's differed by up to 0.86 (SmolLM2's 0.36), because the kernel's int8 activation rounding
turns a last-bit difference into a whole rounding step (docs/scale-out.md, "Numerics"). TOL is
5e-4: ten times the float rounding seen, a thousand times below a different model."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tp_greedy import NEW_TOKENS, PROMPTS, Run, load, run_greedy

from freetoken.weights.source import resolve_model

pytestmark = pytest.mark.real_model

HERE = Path(__file__).resolve().parent
RANK_DEADLINE_S = 900
TOL = 5e-4
TOP_K = 5


def comparable_rows(reference: Run, other: Run) -> list[int]:
    """The rows whose inputs are the same in both runs: every prefill row, and each prompt's
    decode rows until its greedy tokens first differ (rows: prefill, then one per prompt and step)."""
    batch, steps = len(reference.tokens), len(reference.tokens[0])
    prefill = reference.top_ids.shape[0] - batch * (steps - 1)
    rows = list(range(prefill))
    for r, (mine, theirs) in enumerate(zip(reference.tokens, other.tokens)):
        same = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), steps)
        rows += [prefill + (s - 1) * batch + r for s in range(1, min(same + 1, steps))]  # step s reads token s - 1
    return rows


def top_k_difference(reference: Run, other: Run) -> float:
    """Largest |log p| difference over the reference's top-k tokens of every comparable row
    (infinite where such a token is not among the other run's saved best)."""
    worst = 0.0
    for row in comparable_rows(reference, other):
        where = dict(zip(other.top_ids[row].tolist(), other.top_logprobs[row].tolist()))
        for t, lp in zip(reference.top_ids[row, :TOP_K].tolist(), reference.top_logprobs[row, :TOP_K].tolist()):
            worst = max(worst, abs(where[t] - lp) if t in where else float("inf"))
    return worst


def gguf(name: str) -> str:
    return str(resolve_model(name).path)  # a declared dependency: a load failure fails the test


def tp(model: str, world: int, weights: str, caches: list[str], new_tokens: int, out: Path) -> dict[str, Run]:
    from serving import free_port

    cmd = [sys.executable, str(HERE / "tp_greedy.py")]
    port = str(free_port())
    args = [str(out), model, weights, ",".join(caches), str(new_tokens)]
    procs = [subprocess.Popen([*cmd, str(rank), str(world), port, *args]) for rank in range(world)]
    assert [p.wait(RANK_DEADLINE_S) for p in procs] == [0] * world
    return {cache: Run(**fields) for cache, fields in torch.load(out).items()}


# SmolLM2-135M (Q4_1): 9 heads and 3 KV heads split over 3 ranks (GQA, one KV head each).
@pytest.mark.parametrize("name, world, weights, caches, new_tokens", [
    ("gemma3-270m", 2, "auto", ["auto", "int8"], NEW_TOKENS),
    ("gemma3-270m", 2, "bf16", ["auto"], 16),
    ("smollm2-135m-instruct", 3, "auto", ["int8"], 16),
])
def test_tp_is_the_tp1_model(name: str, world: int, weights: str, caches: list[str], new_tokens: int,
                             tmp_path: Path) -> None:
    model = gguf(name)
    got = tp(model, world, weights, caches, new_tokens, tmp_path / "tp.pt")
    loaded = load(model, weights)
    for cache in caches:
        reference = run_greedy(loaded, cache, new_tokens)
        difference = top_k_difference(reference, got[cache])
        print(f"{name} TP={world}, weights {weights}, K/V {cache}: max |top-{TOP_K} log p difference| {difference:.2e}")
        assert difference <= TOL, f"top-{TOP_K} log p differ by {difference:.3g}"
        texts = [loaded.tokenizer.decode(t) for t in reference.tokens]
        assert [loaded.tokenizer.decode(t) for t in got[cache].tokens] == texts
        assert all(len(t) == new_tokens for t in reference.tokens) and len(set(texts)) == len(PROMPTS)
