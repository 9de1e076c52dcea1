"""Model benchmark (issue 2): FreeToken's model path beside transformers on the same .gguf file.

Owns measuring, for each bundled real model and dtype, load time, peak RSS, prefill tokens/s on
one long prompt and single-stream greedy decode tokens/s, for both implementations in the same
run. Each (model, dtype, implementation) runs in its own child process, so its load time and peak
RSS are its own. It prints a markdown table; it changes no project code and asserts nothing.

    python benchmarks/model_bench.py                     # everything: 2 models x 2 dtypes x 2 impls
    python benchmarks/model_bench.py --models gemma3-270m --dtypes bfloat16 --profile

What is timed:
- load: GGUF file -> model with weights, ready to run (no tokenizer on either side).
  FreeToken: resolve_model + load_checkpoint + build_model + load_weights.
  transformers: AutoModelForCausalLM.from_pretrained(dir, gguf_file=name, dtype=..., eager).
- prefill: one forward over a `--prefill-tokens` prompt (seeded random ids), logits of the last
  token only, K/V written to a cache (FreeToken: fresh paged cache; transformers: use_cache=True);
  best of `--reps` runs after one warm-up.
- decode: `--decode-tokens` greedy tokens after a `--decode-prompt`-token prompt. FreeToken: one
  forward per token through the paged cache (ForwardBatch built per step, as the engine will).
  transformers: generate(do_sample=False, use_cache=True); decode time = time(generate N+1 tokens)
  - time(generate 1 token), so its prefill and set-up are not counted. EOS is ignored on both sides;
  best of `--reps` runs after a short warm-up.
Best-of, not median: on a shared machine other processes only ever make a run slower, so the
fastest run is the closest to the code's own speed. The load average is printed with the table.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import resource
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch

MODELS = ("gemma3-270m", "smollm2-135m-instruct")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
IMPLS = ("freetoken", "transformers")
PAGE_SIZE = 16


@dataclass
class Result:
    model: str
    dtype: str
    impl: str
    load_s: float
    peak_rss_mb: float
    prefill_tok_s: float
    decode_tok_s: float
    load_1m: float  # the machine's 1-minute load average when the measurement ended


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def prompt_ids(vocab: int, length: int, seed: int) -> list[int]:
    """Seeded ids from the ordinary part of the vocabulary (no special tokens at the low end)."""
    rng = np.random.default_rng(seed)
    return rng.integers(1000, min(vocab, 30_000), size=length).tolist()


class FreeTokenRunner:
    """FreeToken's model driven directly: one request, pages 1..n in order in both pools."""

    def __init__(self, model_name: str, dtype: torch.dtype) -> None:
        from freetoken.models.registry import build_model, config_from_hf
        from freetoken.weights.loader import load_checkpoint, resolve_model

        ckpt = load_checkpoint(resolve_model(model_name), dtype)
        self.config = config_from_hf(ckpt.hf_config)
        self.model = build_model(self.config, dtype, "cpu")
        self.model.load_weights(ckpt.tensors)
        self.model.eval()
        self.dtype = dtype
        self.vocab = self.config.vocab_size

    def _cache(self, tokens: int) -> tuple[object, np.ndarray, np.ndarray | None]:
        from freetoken.kv.tensors import KVTensors

        pages = -(-tokens // PAGE_SIZE)
        kv = KVTensors(self.config.kv_layout(), pages, pages, PAGE_SIZE, self.dtype, "cpu")
        table = np.arange(1, pages + 1, dtype=np.int32)
        return kv, table, (table.copy() if self.config.has_swa else None)

    def _forward(self, kv: object, table: np.ndarray, swa: np.ndarray | None, start: int, ids: list[int]) -> torch.Tensor:
        from freetoken.attention.metadata import ForwardBatch

        batch = ForwardBatch.build([(start, len(ids), table, swa)], PAGE_SIZE, sliding_window=self.config.sliding_window)
        return self.model(torch.tensor(ids), batch, kv)[-1]  # [vocab]

    @torch.inference_mode()
    def prefill(self, ids: list[int]) -> float:
        kv, table, swa = self._cache(len(ids))
        t0 = time.perf_counter()
        self._forward(kv, table, swa, 0, ids)
        return time.perf_counter() - t0

    @torch.inference_mode()
    def decode(self, ids: list[int], new_tokens: int) -> float:
        """Seconds for `new_tokens` single-token forwards after the prompt (prefill not counted)."""
        kv, table, swa = self._cache(len(ids) + new_tokens + 1)
        token = int(self._forward(kv, table, swa, 0, ids).argmax())
        start = len(ids)
        t0 = time.perf_counter()
        for _ in range(new_tokens):
            token = int(self._forward(kv, table, swa, start, [token]).argmax())
            start += 1
        return time.perf_counter() - t0


class TransformersRunner:
    """transformers on the same .gguf, eager attention."""

    def __init__(self, model_name: str, dtype: torch.dtype) -> None:
        import transformers

        from freetoken.weights.loader import resolve_model

        path = resolve_model(model_name).path  # only to find the file
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=dtype, attn_implementation="eager"
        ).eval()
        self.vocab = self.model.config.vocab_size

    @torch.inference_mode()
    def prefill(self, ids: list[int]) -> float:
        x = torch.tensor([ids])
        t0 = time.perf_counter()
        self.model(x, use_cache=True, logits_to_keep=1)
        return time.perf_counter() - t0

    @torch.inference_mode()
    def _generate(self, x: torch.Tensor, new_tokens: int) -> float:
        t0 = time.perf_counter()
        self.model.generate(
            x, attention_mask=torch.ones_like(x), do_sample=False, use_cache=True,
            max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0,
        )
        return time.perf_counter() - t0

    def decode(self, ids: list[int], new_tokens: int) -> float:
        x = torch.tensor([ids])
        return self._generate(x, new_tokens + 1) - self._generate(x, 1)


def run_one(args: argparse.Namespace) -> Result:
    torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype]
    t0 = time.perf_counter()
    runner = FreeTokenRunner(args.model, dtype) if args.impl == "freetoken" else TransformersRunner(args.model, dtype)
    load_s = time.perf_counter() - t0

    long_prompt = prompt_ids(runner.vocab, args.prefill_tokens, seed=1)
    runner.prefill(long_prompt[:32])  # warm-up
    prefill_s = min(runner.prefill(long_prompt) for _ in range(args.reps))

    short_prompt = prompt_ids(runner.vocab, args.decode_prompt, seed=2)
    runner.decode(short_prompt, 4)  # warm-up
    decode_s = min(runner.decode(short_prompt, args.decode_tokens) for _ in range(args.reps))
    if args.profile:  # an extra, untimed run: cProfile's overhead must not reach the table
        profiler = cProfile.Profile()
        profiler.enable()
        runner.decode(short_prompt, args.decode_tokens)
        profiler.disable()
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(25)
        print(f"--- cProfile of {args.impl} decode ({args.model}, {args.dtype}) ---\n{out.getvalue()}", file=sys.stderr)
    return Result(
        args.model, args.dtype, args.impl, load_s, peak_rss_mb(),
        args.prefill_tokens / prefill_s, args.decode_tokens / decode_s, os.getloadavg()[0],
    )


def markdown(results: list[Result], args: argparse.Namespace) -> str:
    lines = [
        f"| model | dtype | impl | load s | peak RSS MiB | prefill tok/s ({args.prefill_tokens}) | "
        f"decode tok/s ({args.decode_tokens} after {args.decode_prompt}) | load 1m |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r.model} | {r.dtype} | {r.impl} | {r.load_s:.1f} | {r.peak_rss_mb:.0f} | "
            f"{r.prefill_tok_s:.1f} | {r.decode_tok_s:.2f} | {r.load_1m:.1f} |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    p.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    p.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    p.add_argument("--prefill-tokens", type=int, default=512)
    p.add_argument("--decode-prompt", type=int, default=32, help="prompt tokens before the timed decode")
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=3, help="timed prefill and decode runs (best of)")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    p.add_argument("--profile", action="store_true", help="cProfile one extra decode loop to stderr")
    p.add_argument("--json", action="store_true", help="also print the results as JSON lines")
    # Internal: one measurement in this process (the parent starts one child per combination).
    p.add_argument("--child", nargs=3, metavar=("MODEL", "DTYPE", "IMPL"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


def child_command(args: argparse.Namespace, model: str, dtype: str, impl: str) -> list[str]:
    cmd = [sys.executable, __file__, "--child", model, dtype, impl,
           "--prefill-tokens", str(args.prefill_tokens), "--decode-prompt", str(args.decode_prompt),
           "--decode-tokens", str(args.decode_tokens), "--reps", str(args.reps), "--threads", str(args.threads)]
    return cmd + (["--profile"] if args.profile else [])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        args.model, args.dtype, args.impl = args.child
        print("RESULT " + json.dumps(asdict(run_one(args))), flush=True)
        return 0
    results = []
    for model in args.models:
        for dtype in args.dtypes:
            for impl in args.impls:
                print(f"[model_bench] {model} {dtype} {impl} ...", file=sys.stderr, flush=True)
                proc = subprocess.run(child_command(args, model, dtype, impl), stdout=subprocess.PIPE, text=True)
                lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
                if proc.returncode != 0 or not lines:
                    print(f"[model_bench] {model} {dtype} {impl} failed (exit {proc.returncode})", file=sys.stderr)
                    continue
                results.append(Result(**json.loads(lines[-1][len("RESULT "):])))
                print(f"[model_bench] {results[-1]}", file=sys.stderr, flush=True)
    load = " / ".join(f"{x:.2f}" for x in os.getloadavg())
    print(markdown(results, args))
    print(f"\nload average at the end (1/5/15 min): {load} on {os.cpu_count()} CPUs; torch {torch.__version__}")
    if args.json:
        for r in results:
            print(json.dumps(asdict(r)))
    return 0 if results else 1


if __name__ == "__main__":
    sys.exit(main())
