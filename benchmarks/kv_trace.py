"""Cost of the KV core's bookkeeping per request on a synthetic trace (a script, not a test).

Builds a trace of chat-like requests: each starts with one of a few long system prompts, often
continues an earlier conversation (its whole previous prompt + a new turn) and ends with a fresh
tail, so the radix tree grows to about `--tree-tokens` distinct tokens. Each request is admitted
(match + lease), extended to its whole prompt in one chunk (allocation, evicting as needed),
committed (prompt + one output token), released. Prints the mean and p99 cost of match, commit
and extend (allocation + eviction), per request, in microseconds.

    python benchmarks/kv_trace.py --page-size 16 --requests 10000 --tree-tokens 1000000
"""

from __future__ import annotations

import argparse
import random
import time

import numpy as np

from freetoken.kv.manager import KVManager


def build_trace(n: int, tree_tokens: int, seed: int) -> list[tuple[list[int], int]]:
    """(prompt, boundary) pairs; about tree_tokens distinct tokens in all."""
    rng = random.Random(seed)
    systems = [[rng.randrange(50_000) for _ in range(2_000)] for _ in range(20)]
    tail_len = max(16, (tree_tokens - 40_000) // n)
    convs: list[list[int]] = []
    trace = []
    for _ in range(n):
        if convs and rng.random() < 0.5:
            base = rng.choice(convs)
            if len(base) > 16_000:
                base = rng.choice(systems)
        else:
            base = rng.choice(systems)
        prompt = base + [rng.randrange(50_000) for _ in range(rng.randint(tail_len // 2, tail_len * 3 // 2))]
        convs.append(prompt)
        if len(convs) > 500:
            convs.pop(0)
        trace.append((prompt, len(base)))
    return trace


def run(page_size: int, n: int, tree_tokens: int, window: int, seed: int) -> dict[str, float]:
    trace = build_trace(n, tree_tokens, seed)
    full_pages = tree_tokens // page_size // 2  # half the distinct tokens fit: eviction runs
    swa_pages = max(full_pages // 4, 64 * (window // page_size + 2))
    kv = KVManager(full_pages=full_pages, swa_pages=swa_pages, page_size=page_size,
                   window=window, cache_type="radix")
    t_match, t_extend, t_commit, hits, total = [], [], [], 0, 0
    for i, (prompt, boundary) in enumerate(trace):
        rid = f"r{i}"
        t0 = time.perf_counter()
        cached = kv.admit(rid, prompt)
        t1 = time.perf_counter()
        ok = kv.extend(rid, len(prompt) + 1)
        t2 = time.perf_counter()
        if not ok:
            kv.release(rid)
            continue
        kv.release_out_of_window(rid, len(prompt))  # the engine would do this per chunk
        written = prompt  # prompt + output - 1 with one output token
        t3 = time.perf_counter()
        kv.commit(rid, written, (boundary,))
        t4 = time.perf_counter()
        kv.release(rid)
        t_match.append(t1 - t0)
        t_extend.append(t2 - t1)
        t_commit.append(t4 - t3)
        hits += cached
        total += len(prompt)
    report = kv.audit(idle=True)
    assert report.ok, str(report)
    us = lambda xs: (1e6 * float(np.mean(xs)), 1e6 * float(np.percentile(xs, 99)))
    out = {"requests": len(t_match), "hit_rate": hits / max(total, 1),
           "tree_nodes": sum(1 for _ in kv.tree.nodes())}
    for name, xs in (("match", t_match), ("extend+evict", t_extend), ("commit", t_commit)):
        out[f"{name}_mean_us"], out[f"{name}_p99_us"] = us(xs)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--page-size", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--tree-tokens", type=int, default=1_000_000)
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    for p in args.page_size:
        start = time.perf_counter()
        res = run(p, args.requests, args.tree_tokens, args.window, args.seed)
        res["wall_s"] = time.perf_counter() - start
        print(f"page_size={p} " + " ".join(
            f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in res.items()))


if __name__ == "__main__":
    main()
