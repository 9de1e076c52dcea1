"""One decode forward in-process: how much of it is the linear layers and how much the rest.

    python benchmarks/decode_step_bench.py [--model gemma3-270m] [--batch 1] [--context 100] [--threads 2] [--reps 40]
                                           [--clock wall|cpu] [--dtype bfloat16|float32] [--group32-fallback]

Times `model(ids, batch, kv)` for `--batch` requests decoding one token each after `--context`
cached tokens (median of 40 after a warm-up), with the model loaded as `ft serve` loads it
(`--weights auto`), then again with every linear layer replaced by an empty output of the right
shape: the difference is what the weights cost, the remainder the step's other ops. `--clock cpu`
times the calling thread's CPU time (`time.thread_time`) instead of the wall clock: steadier on a
shared machine, and exact at `--threads 1` (with more threads it misses the helper threads' share).
`--group32-fallback` loads as if the group-32 kernel were not there (torch's fallback: dense copies
of those weights, what a CPU without the kernel runs), for its cost beside the kernel's. The weights'
bytes held (models/memory.py's `weight_bytes`) are printed with the times.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from freetoken.attention.metadata import ForwardBatch
from freetoken.kv.tensors import KVTensors
from freetoken.models.linear import QuantizableWeight
from freetoken.models.load import load_model
from freetoken.models.memory import weight_bytes


def median_ms(run, reps: int = 40, clock=time.perf_counter) -> float:  # type: ignore[no-untyped-def]
    for _ in range(5):
        run()
    times = []
    for _ in range(reps):
        t = clock()
        run()
        times.append(clock() - t)
    return sorted(times)[reps // 2] * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--weights", default="auto")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=100)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    ap.add_argument("--group32-fallback", action="store_true", help="load as if the group-32 kernel were not built")
    args = ap.parse_args()
    if args.group32_fallback:  # before anything is packed: PackedWeight binds its path when built
        import sys

        qlinear = sys.modules["freetoken.ops.qlinear"]
        qlinear._KERNEL, qlinear._FIVE_BITS = None, False
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    torch.set_num_threads(args.threads)
    loaded = load_model(args.model, getattr(torch, args.dtype), torch.device("cpu"), args.weights)
    model, c = loaded.model, loaded.config
    P = 16
    pages = -(-(args.context + 1) // P)
    kv = KVTensors(c.kv_layout(), pages * args.batch, pages * args.batch, P, getattr(torch, args.dtype), "cpu")
    specs = []
    for b in range(args.batch):
        table = np.arange(1 + b * pages, 1 + (b + 1) * pages, dtype=np.int32)
        specs.append((args.context, 1, table, table if c.has_swa else None))
    ids = torch.full((args.batch,), 5)
    window = c.sliding_window if c.has_swa else None

    def run() -> None:
        with torch.inference_mode():
            model(ids, ForwardBatch.build(specs, P, sliding_window=window), kv)

    full = median_ms(run, args.reps, clock)

    def empty(self: QuantizableWeight, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        n = self.packed.out_features if self.packed is not None else self.weight.shape[0]  # type: ignore[union-attr]
        return torch.empty(x.shape[0], n, dtype=x.dtype)

    QuantizableWeight.project = empty  # type: ignore[method-assign]
    rest = median_ms(run, args.reps, clock)
    held = weight_bytes(model)
    kernel = "group-32 fallback" if args.group32_fallback else "kernels"
    print(f"{args.model} --weights {args.weights}, {args.dtype}, {kernel}, batch {args.batch}, context {args.context}, "
          f"{args.threads} threads, {args.clock} clock: forward {full:.2f} ms, linear layers {full - rest:.2f} ms, the rest {rest:.2f} ms; "
          f"weights held {held['weights'] >> 20} MiB (prefill copies {held['prefill_copies'] >> 20} MiB)")


if __name__ == "__main__":
    main()
