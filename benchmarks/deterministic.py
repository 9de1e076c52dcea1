"""What `--deterministic` buys and costs: greedy agreement on code prompts, and prefill / decode time.

    python benchmarks/deterministic.py agreement [--model gemma3-270m] [--prompts 4] [--tokens 100] [--deterministic]
    python benchmarks/deterministic.py cost --model M [--lengths 512,1024,2048] [--rounds 3]

`agreement`: N code prompts (the first 3000 characters of this project's own sources), greedy,
`ignore_eos`: each alone (no prefix cache, one request at a time) is the reference; then all of
them batched together, each sent twice to one engine (the second a prefix-cache hit), and each
with `--speculative ngram`; prints how many are identical to the reference and where each first
differs. `cost`: both modes' engines in one process, rounds alternating which goes first: a cold
prefill (`max_tokens` 1) of random-token prompts of each length and a 64-token greedy decode;
medians, and the median of the per-round ratios deterministic / default.
"""

from __future__ import annotations

import argparse
import glob
import random
import statistics
import time
from pathlib import Path

from freetoken.config import EngineConfig
from freetoken.llm import LLM
from freetoken.request import SamplingParams


def code_prompts(n: int) -> list[str]:
    root = Path(__file__).resolve().parents[1] / "freetoken"
    texts = [Path(f).read_text()[:3000] for f in sorted(glob.glob(str(root / "**" / "*.py"), recursive=True))]
    return [t for t in texts if len(t) == 3000][:n]


def engine(model: str, **flags: object) -> LLM:
    return LLM(config=EngineConfig(model=model, threads=2, num_tokens=16384, **flags))  # type: ignore[arg-type]


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def agreement(a: argparse.Namespace) -> None:
    prompts = code_prompts(a.prompts)
    greedy = SamplingParams(max_tokens=a.tokens, temperature=0.0, ignore_eos=True)
    det = {"deterministic": a.deterministic}
    solo = engine(a.model, cache_type="naive", max_running_requests=1, **det)
    alone = [solo.generate([p], greedy)[0].token_ids for p in prompts]
    del solo
    batched = [o.token_ids for o in engine(a.model, cache_type="naive", **det).generate(prompts, greedy)]
    radix = engine(a.model, **det)
    for p in prompts:
        radix.generate([p], greedy)
    again = [radix.generate([p], greedy)[0] for p in prompts]
    del radix
    spec = engine(a.model, cache_type="naive", max_running_requests=1, speculative="ngram", **det)
    speculative = [spec.generate([p], greedy)[0].token_ids for p in prompts]
    print(f"{a.model}, deterministic={a.deterministic}, {len(prompts)} prompts x {a.tokens} tokens; "
          f"cached on the second send: {[o.cached_tokens for o in again]}")
    for name, outs in (("batched", batched), ("cache hit", [o.token_ids for o in again]), ("speculative", speculative)):
        same = sum(x == y for x, y in zip(alone, outs))
        print(f"{name:12s} {same}/{len(prompts)} identical to alone; first differences {[first_difference(x, y) for x, y in zip(alone, outs)]}")


def cost(a: argparse.Namespace) -> None:
    lengths = [int(x) for x in a.lengths.split(",")]
    llms = {d: engine(a.model, cache_type="naive", deterministic=d) for d in (False, True)}
    rng = random.Random(0)
    times: dict[tuple[bool, object], list[float]] = {(d, k): [] for d in llms for k in [*lengths, "decode"]}
    for r in range(a.rounds):
        for d in (False, True) if r % 2 == 0 else (True, False):
            for n in lengths:
                ids = [rng.randrange(1000, 30000) for _ in range(n)]
                t = time.perf_counter()
                llms[d].generate([ids], SamplingParams(max_tokens=1, temperature=0.0))
                times[(d, n)].append(time.perf_counter() - t)
            ids = [rng.randrange(1000, 30000) for _ in range(32)]
            t = time.perf_counter()
            llms[d].generate([ids], SamplingParams(max_tokens=65, temperature=0.0, ignore_eos=True))
            times[(d, "decode")].append(65 / (time.perf_counter() - t))
    for k in [*lengths, "decode"]:
        off, on = times[(False, k)], times[(True, k)]
        unit = "tok/s" if k == "decode" else "s"
        print(f"{'decode 64 tokens' if k == 'decode' else f'prefill {k}'}: default {statistics.median(off):.3f} {unit}, "
              f"deterministic {statistics.median(on):.3f} {unit}, ratio {statistics.median([y / x for x, y in zip(off, on)]):.3f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    g = sub.add_parser("agreement")
    g.add_argument("--model", default="gemma3-270m")
    g.add_argument("--prompts", type=int, default=4)
    g.add_argument("--tokens", type=int, default=100)
    g.add_argument("--deterministic", action="store_true")
    c = sub.add_parser("cost")
    c.add_argument("--model", required=True)
    c.add_argument("--lengths", default="512,1024,2048")
    c.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    agreement(a) if a.what == "agreement" else cost(a)


if __name__ == "__main__":
    main()
