"""Sampler benchmark (issue 9, point 3): time per row of `sample` at Gemma's vocabulary, old vs new.

Owns measuring the top-k-first sampler (freetoken.engine.sampler) beside an inline copy of the
full-sort sampler it replaced, on the same logits and requests, at a fixed torch thread count.
It prints a markdown table; it changes no project code and asserts nothing.

    python benchmarks/sampler_bench.py                  # vocab 262,144, batch 1 and 16, 2 threads
    python benchmarks/sampler_bench.py --batches 16 --reps 21 --old-reps 3
    python benchmarks/sampler_bench.py --flat --vocab 49152 --threads 1 --clock cpu

`--flat` (issue 24) times only flat rows, whose cut lies past the topk (the deep cut), against
greedy on the same rows: the sampler as it is beside the same sampler with its deep cut forced
onto the torch ops (the C++ kernel patched out), and how many tokens a row keeps. The rows are
those of the random-weight benchmark models (N(0, 0.3) logits: top_p 0.95 at temperature 0.8
keeps ~90% of the vocabulary) and wider N(0, 2) ones. `--clock cpu` times with
`time.thread_time` (the CPU time of this thread: a shared machine's other load does not count).

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
    logits: str  # "peaked" or "flat"; FLAT_CASES: "flat <scale of the N(0, scale) logits>"
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


CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}
clock = time.perf_counter


def time_per_row(fn, logits: torch.Tensor, reqs: list[Request], reps: int) -> float:
    """Median seconds per row over `reps` calls, after two warm-ups."""
    times = []
    for rep in range(reps + 2):
        x = logits.clone()
        start = clock()
        fn(x, reqs)
        if rep >= 2:
            times.append(clock() - start)
    return statistics.median(times) / logits.shape[0]


# ---- flat rows (issue 24): the deep cut, native against torch ----

FLAT_CASES = (
    Case("greedy", SamplingParams(temperature=0.0), "flat 0.3"),
    Case("temperature 0.8, top_p 0.95", SamplingParams(temperature=0.8, top_p=0.95), "flat 0.3"),
    Case("temperature 0.8, min_p 0.05", SamplingParams(temperature=0.8, min_p=0.05), "flat 0.3"),
    Case("temperature 0.8, top_p 0.95, min_p 0.01", SamplingParams(temperature=0.8, top_p=0.95, min_p=0.01), "flat 0.3"),
    Case("temperature 0.8, top_p 0.95, N(0, 2) rows", SamplingParams(temperature=0.8, top_p=0.95), "flat 2"),
)


def flat_logits(kind: str, batch: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, vocab, generator=g) * float(kind.split()[1])).bfloat16().float()


def kept_per_row(logits: torch.Tensor, params: SamplingParams) -> float:
    from freetoken.engine.sampler import filtered_distribution

    if params.greedy:
        return 1.0
    _, probs = filtered_distribution(logits / params.temperature, [params] * len(logits))
    return float((probs > 0).sum()) / len(logits)


def torch_deep_cut(fn):
    """`fn` with the sampler's deep cut on its torch ops (None where this tree has no kernel)."""
    import freetoken.engine.sampler as sampler

    if not hasattr(sampler, "deep_cut"):
        return None

    def run(x: torch.Tensor, reqs: list[Request]) -> object:
        kernel, sampler.deep_cut = sampler.deep_cut, lambda *args: None
        try:
            return fn(x, reqs)
        finally:
            sampler.deep_cut = kernel

    return run


def main_flat(args: argparse.Namespace) -> None:
    print(f"vocab {args.vocab:,}, flat rows, torch {torch.__version__}, {args.threads} threads, "
          f"{args.clock} time, median per row\n")
    print("| case | batch | kept tokens/row | torch deep cut ms/row | ms/row | speed-up |")
    print("|---|---|---|---|---|---|")
    for case in FLAT_CASES:
        for batch in args.batches:
            logits = flat_logits(case.logits, batch, args.vocab, seed=batch)
            reqs = make_requests(case, batch, args.vocab)
            baseline = torch_deep_cut(sample)
            old = time_per_row(baseline, logits, reqs, args.reps) if baseline and not case.params.greedy else None
            new = time_per_row(sample, logits, reqs, args.reps)
            cells = (f"{old * 1e3:.3f}", f"{old / new:.1f}x") if old else ("-", "-")
            print(f"| {case.name} | {batch} | {kept_per_row(logits, case.params):,.0f} | {cells[0]} | "
                  f"{new * 1e3:.3f} | {cells[1]} |", flush=True)
    print(f"\nload average {os.getloadavg()[0]:.2f} (1 min), {os.cpu_count()} CPUs")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=VOCAB)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=15, help="timed calls of the new sampler per cell")
    ap.add_argument("--old-reps", type=int, default=5, help="timed calls of the old one (it is slow)")
    ap.add_argument("--gguf", help="take the peaked rows from this model's logits (e.g. Gemma 3 270M)")
    ap.add_argument("--flat", action="store_true", help="flat rows only: the deep cut, native against torch")
    ap.add_argument("--clock", choices=sorted(CLOCKS), default="wall", help="cpu: this thread's CPU time")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    global clock
    clock = CLOCKS[args.clock]
    if args.flat:
        main_flat(args)
        return
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
