"""Engine throughput on the real models, and the scheduler's own cost per step.

    python benchmarks/engine_bench.py [--models gemma3-270m smollm2-135m-instruct] [--dtype bfloat16]

Decode tokens/s at batch 1, 4 and 16 (short distinct prompts, 32 new tokens each, greedy,
ignore_eos), prefill tokens/s of one 512-token prompt, and the engine's time per step with a
model that does nothing (so the number is scheduling + KV bookkeeping + sampling of 16
requests). Prints markdown tables.
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from freetoken.config import EngineConfig
from freetoken.llm import LLM
from freetoken.models.load import load_model
from freetoken.request import Request, SamplingParams


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, min(vocab, 30000)) for _ in range(length)] for _ in range(n)]


def bench_model(name: str, dtype: str, threads: int) -> list[str]:
    torch.set_num_threads(threads)
    loaded = load_model(name, {"bfloat16": torch.bfloat16, "float32": torch.float32}[dtype], torch.device("cpu"))
    vocab = loaded.config.vocab_size
    config = EngineConfig(model=name, dtype=dtype, num_tokens=16 * 1024, max_running_requests=16, max_prefill_length=512)
    rows = []
    llm = LLM(config=config, loaded=loaded)
    llm.generate(prompts(1, 32, vocab, 0), SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))  # warm-up
    t = time.perf_counter()
    llm.generate(prompts(1, 512, vocab, 1), SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    prefill = 512 / (time.perf_counter() - t)
    rows.append(f"| {name} | {dtype} | prefill, 512-token prompt | {prefill:.0f} tok/s |")
    for batch in (1, 4, 16):
        llm = LLM(config=config, loaded=loaded)  # a fresh cache: no prefix hits between runs
        ps = prompts(batch, 16, vocab, 10 + batch)
        t = time.perf_counter()
        llm.generate(ps, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
        t_prefill = time.perf_counter() - t
        llm = LLM(config=config, loaded=loaded)
        t = time.perf_counter()
        llm.generate(ps, SamplingParams(max_tokens=33, temperature=0, ignore_eos=True))
        decode = batch * 32 / (time.perf_counter() - t - t_prefill)
        rows.append(f"| {name} | {dtype} | decode, batch {batch} | {decode:.1f} tok/s |")
    return rows


class NullModel(torch.nn.Module):
    """Returns zero logits: isolates the engine's own work per step."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab = vocab

    def forward(self, input_ids, batch, kv):  # type: ignore[no-untyped-def]
        return torch.zeros(len(batch.logits_indices), self.vocab)


def bench_scheduler(steps: int = 100) -> list[str]:
    from freetoken.engine.engine import Engine
    from freetoken.engine.runner import Runner
    from freetoken.kv.manager import KVManager
    from freetoken.kv.tensors import KVLayout, KVTensors
    from freetoken.models.registry import config_from_hf

    rows = []
    for window, vocab in ((None, 32000), (512, 32000), (512, 262144)):
        cfg = config_from_hf({
            "model_type": "gemma3_text" if window else "llama", "vocab_size": vocab, "hidden_size": 64,
            "intermediate_size": 64, "num_hidden_layers": 6, "num_attention_heads": 1, "num_key_value_heads": 1,
            "head_dim": 8, "sliding_window": window or 4096, "max_position_embeddings": 32768,
        })
        engine_cfg = EngineConfig(num_tokens=64 * 1024, max_running_requests=16, max_prefill_length=512)
        resolved = engine_cfg.resolve(model_context_length=32768, window=window if cfg.has_swa else None,
                                      kv_bytes_per_token=1, available_bytes=1 << 30)
        kv = KVManager(full_pages=resolved.full_pages, swa_pages=resolved.swa_pages, page_size=16,
                       window=window if cfg.has_swa else None, cache_type="radix")
        layout = KVLayout(tuple(False for _ in range(1)), 1, 8)
        tensors = KVTensors(layout, 1, 0, 16, torch.float32, "cpu")
        engine = Engine(resolved, Runner(NullModel(cfg.vocab_size), cfg, tensors), kv)
        for i, p in enumerate(prompts(16, 200, 30000, 99)):
            engine.add_request(Request(f"r{i}", p, SamplingParams(max_tokens=10_000, temperature=0.7, seed=i)))
        while any(r.num_computed < len(r.prompt_ids) for r in engine.requests.values()):
            engine.step()
        t = time.perf_counter()
        for _ in range(steps):
            engine.step()
        per_step = (time.perf_counter() - t) / steps * 1e3
        kind = "sliding window 512 (swa_radix)" if cfg.has_swa else "full attention (radix)"
        rows.append(f"| {kind} | {vocab} | 16 decoding requests | {per_step:.2f} ms/step |")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="*", default=["gemma3-270m", "smollm2-135m-instruct"])
    ap.add_argument("--dtype", nargs="*", default=["bfloat16"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--skip-models", action="store_true")
    args = ap.parse_args()
    print("| model | dtype | measure | result |\n|---|---|---|---|")
    if not args.skip_models:
        for name in args.models:
            for dtype in args.dtype:
                for row in bench_model(name, dtype, args.threads):
                    print(row, flush=True)
    print("\n| engine (null model) | vocab | load | scheduler + KV + sampling |\n|---|---|---|---|")
    for row in bench_scheduler():
        print(row, flush=True)


if __name__ == "__main__":
    main()
