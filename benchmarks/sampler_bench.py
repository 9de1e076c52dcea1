"""Sampler benchmark (issue 9, point 3): time per row of `sample` at Gemma's vocabulary, old vs new.

Owns measuring the top-k-first sampler (freetoken.engine.sampler) beside an inline copy of the
full-sort sampler it replaced, on the same logits and requests, at a fixed torch thread count.
It prints a markdown table; it changes no project code and asserts nothing.

    python benchmarks/sampler_bench.py                  # vocab 262,144, batch 1 and 16, 2 threads
    python benchmarks/sampler_bench.py --batches 16 --reps 21 --old-reps 3

Logits: "peaked" rows shaped like a language model's (a bulk of N(0, 2) logits over the
vocabulary, 32 candidates lifted 10-20 above it, rounded to bfloat16 as the model emits them, so
equal logits occur), or with `--gguf FILE` the real rows of Gemma 3 270M (transformers runs the
file on a fixed 38-token text; row i of a batch is position i; at temperature 0.8, top_p 0.95
they keep 1-85 tokens); "flat" rows (N(0, 2) only) are the worst case of top_p, whose cut then
lies ~50,000 tokens deep, past the first topk. Each timed call gets a fresh copy of the logits (the
copy is not timed, as the engine hands the sampler a copy). The median of `--reps` calls after
two warm-ups is reported per row (call time / batch); the load average is printed with the table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from freetoken.engine.sampler import sample  # noqa: E402
from freetoken.request import Request, SamplingParams  # noqa: E402

VOCAB = 262_144


# ---- the full-sort sampler as it was before issue 9 (freetoken/engine/sampler.py at 8264eb3) ----


def old_penalize(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
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


def old_filter(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
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
        drop |= (probs.cumsum(dim=-1) - probs) >= top_p[:, None]
        drop |= probs < (min_p[:, None] * probs[:, :1])
        drop[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
    return logits


def old_sample(logits: torch.Tensor, requests: list[Request]) -> list[int]:
    logits = logits.float()
    params = [r.params for r in requests]
    if any(p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty for p in params):
        old_penalize(logits, requests)
    chosen = [0] * len(requests)
    greedy = [i for i, p in enumerate(params) if p.greedy]
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    if greedy:
        for i, tok in zip(greedy, logits[greedy].argmax(dim=-1).tolist()):
            chosen[i] = tok
    if sampled:
        probs = old_filter(logits[sampled], [params[i] for i in sampled]).softmax(dim=-1)
        cdf = probs.cumsum(dim=-1)
        u = torch.stack([torch.rand((), generator=requests[i].generator, dtype=cdf.dtype) for i in sampled])
        picks = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None]).clamp_(max=logits.shape[1] - 1)
        for row, i in enumerate(sampled):
            chosen[i] = int(picks[row, 0])
    return chosen


# ---- the measurement ----


@dataclass(frozen=True)
class Case:
    name: str
    params: SamplingParams
    logits: str  # "peaked" or "flat"
    history: bool = False  # a 1,000-token prompt and 200 output tokens (what penalties read)


CASES = (
    Case("greedy", SamplingParams(temperature=0.0), "peaked"),
    Case("temperature 0.8 (no filter)", SamplingParams(temperature=0.8), "peaked"),
    Case("temperature 0.8, top_p 0.95", SamplingParams(temperature=0.8, top_p=0.95), "peaked"),
    Case("top_k 40", SamplingParams(top_k=40), "peaked"),
    Case("min_p 0.05", SamplingParams(min_p=0.05), "peaked"),
    Case(
        "penalties (rep 1.1, freq 0.3, pres 0.3) + temp 0.8, top_p 0.95",
        SamplingParams(temperature=0.8, top_p=0.95, repetition_penalty=1.1, frequency_penalty=0.3, presence_penalty=0.3),
        "peaked",
        history=True,
    ),
    Case("temperature 0.8, top_p 0.95, flat rows (worst case)", SamplingParams(temperature=0.8, top_p=0.95), "flat"),
)


TEXT = (
    "Once upon a time, in a small village at the edge of a great forest, there lived an old woman who told "
    "stories to the children. One evening she began a new story about"
)


def gguf_logits(path: str) -> torch.Tensor:
    """Every position's logits of `TEXT` under the model in a .gguf file (transformers, float32)."""
    import transformers

    folder, name = os.path.split(os.path.abspath(path))
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    with torch.no_grad():
        logits = model(tokenizer(TEXT, return_tensors="pt").input_ids).logits[0]  # [T, V]
    return logits.bfloat16().float()


def make_logits(kind: str, batch: int, vocab: int, seed: int, real: torch.Tensor | None) -> torch.Tensor:
    if kind == "peaked" and real is not None:
        return real[torch.arange(batch) % len(real)].clone()  # [B, V]
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, vocab, generator=g) * 2.0  # [B, V]
    if kind == "peaked":
        lifted = torch.randint(0, vocab, (batch, 32), generator=g)  # [B, 32]
        logits.scatter_(1, lifted, 10.0 + 10.0 * torch.rand(batch, 32, generator=g))
    return logits.bfloat16().float()


def make_requests(case: Case, batch: int, vocab: int) -> list[Request]:
    reqs = []
    for i in range(batch):
        prompt = [(i * 7919 + j * 104_729) % vocab for j in range(1000)] if case.history else [1, 2, 3]
        output = [(i * 31 + j * 9973) % vocab for j in range(200)] if case.history else []
        r = Request(f"r{i}", prompt, case.params, output_ids=output)
        r.generator = torch.Generator().manual_seed(i)
        reqs.append(r)
    return reqs


def time_per_row(fn, logits: torch.Tensor, reqs: list[Request], reps: int) -> float:
    """Median seconds per row over `reps` calls, after two warm-ups."""
    times = []
    for rep in range(reps + 2):
        x = logits.clone()
        start = time.perf_counter()
        fn(x, reqs)
        if rep >= 2:
            times.append(time.perf_counter() - start)
    return statistics.median(times) / logits.shape[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=VOCAB)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=15, help="timed calls of the new sampler per cell")
    ap.add_argument("--old-reps", type=int, default=5, help="timed calls of the old one (it is slow)")
    ap.add_argument("--gguf", help="take the peaked rows from this model's logits (e.g. Gemma 3 270M)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    real = gguf_logits(args.gguf) if args.gguf else None
    vocab = args.vocab if real is None else real.shape[1]
    rows = "synthetic" if real is None else f"{os.path.basename(args.gguf)}"
    print(f"vocab {vocab:,}, peaked rows: {rows}, torch {torch.__version__}, {args.threads} threads, median per row\n")
    print("| case | batch | old ms/row | new ms/row | speed-up |")
    print("|---|---|---|---|---|")
    for case in CASES:
        for batch in args.batches:
            logits = make_logits(case.logits, batch, vocab, seed=batch, real=real)
            reqs = make_requests(case, batch, vocab)
            old = time_per_row(old_sample, logits, reqs, args.old_reps)
            new = time_per_row(sample, logits, reqs, args.reps)
            print(f"| {case.name} | {batch} | {old * 1e3:.3f} | {new * 1e3:.3f} | {old / new:.1f}x |", flush=True)
    print(f"\nload average {os.getloadavg()[0]:.2f} (1 min), {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
