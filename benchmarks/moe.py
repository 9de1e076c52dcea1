"""Decode speed of a random MoE whose experts exceed the expert cache: resident vs offload.

    python benchmarks/moe.py [--layers 8] [--experts 32] [--top-k 4] [--hidden 512] [--intermediate 512]
                             [--qtype MXFP4] [--cache-fraction 0.25] [--tokens 48] [--threads 1]

Writes a random gpt-oss-shaped GGUF (llama.cpp's layout: expert stacks in `--qtype`, the rest
float16) to a temporary directory, then runs one engine per configuration in a fresh process (so
peak RSS is that configuration's alone) -- `resident` and `offload` with the experts packed
(`--weights auto`), and `resident` with `--weights bf16` (every expert dequantized to bfloat16, the
path before packed experts): load, one 16-token prompt, `--tokens` greedy
decode steps of one request. Reported per strategy: decode tokens/s from CPU time
(`time.thread_time` at `--threads` 1: steady on a shared machine) and from wall time, the expert
cache's hits / misses / evictions / hit rate, the experts' resident bytes or the cache's budget,
peak RSS (`ru_maxrss`: the load included, and the memory map's touched file pages), the peak of
anonymous memory while decoding and the file pages held at the end (/proc/self/status), and
load time. Routing of random weights is near uniform, so the hit rate is close to the cache's share of
a layer's experts: a worst case next to real models, whose routing is skewed.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import gguf
import numpy as np

VOCAB = 512


def write_model(path: Path, args: argparse.Namespace) -> None:
    rng = np.random.default_rng(0)
    H, I, E, L = args.hidden, args.intermediate, args.experts, args.layers
    heads, kv_heads, head_dim = 8, 2, 64
    qtype = gguf.GGMLQuantizationType[args.qtype]
    w = gguf.GGUFWriter(str(path), "gpt-oss")
    kv = {"block_count": L, "context_length": 4096, "embedding_length": H, "feed_forward_length": I,
          "expert_feed_forward_length": I, "expert_count": E, "expert_used_count": args.top_k,
          "attention.head_count": heads, "attention.head_count_kv": kv_heads, "attention.key_length": head_dim,
          "attention.value_length": head_dim, "attention.sliding_window": 128}
    for key, value in kv.items():
        w.add_uint32(f"gpt-oss.{key}", value)
    w.add_float32("gpt-oss.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_float32("gpt-oss.rope.freq_base", 10000.0)
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(VOCAB)])
    w.add_array("tokenizer.ggml.token_type", [1] * VOCAB)
    w.add_array("tokenizer.ggml.merges", [])
    w.add_uint32("tokenizer.ggml.bos_token_id", 1)
    w.add_uint32("tokenizer.ggml.eos_token_id", 2)

    def f16(*shape: int, scale: float = 0.05) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * scale).astype(np.float16)

    w.add_tensor("token_embd.weight", f16(VOCAB, H, scale=1.0))
    w.add_tensor("output_norm.weight", np.ones(H, np.float32))
    w.add_tensor("output.weight", f16(VOCAB, H))
    for i in range(L):
        b = f"blk.{i}."
        for name in ("attn_norm.weight", "post_attention_norm.weight"):
            w.add_tensor(b + name, np.ones(H, np.float32))
        w.add_tensor(b + "attn_sinks.weight", np.zeros(heads, np.float32))
        for proj, rows, cols in (("q", heads * head_dim, H), ("k", kv_heads * head_dim, H), ("v", kv_heads * head_dim, H),
                                 ("output", H, heads * head_dim)):
            w.add_tensor(f"{b}attn_{proj}.weight", f16(rows, cols))
            w.add_tensor(f"{b}attn_{proj}.bias", np.zeros(rows, np.float32))
        w.add_tensor(b + "ffn_gate_inp.weight", (rng.standard_normal((E, H), dtype=np.float32)).astype(np.float32))
        w.add_tensor(b + "ffn_gate_inp.bias", np.zeros(E, np.float32))
        for proj, rows, cols in (("gate", I, H), ("up", I, H), ("down", H, I)):
            values = rng.standard_normal((E, rows, cols), dtype=np.float32) * 0.05
            w.add_tensor(f"{b}ffn_{proj}_exps.weight", gguf.quants.quantize(values, qtype), raw_dtype=qtype)
            w.add_tensor(f"{b}ffn_{proj}_exps.bias", np.zeros((E, rows), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def rss_mib() -> dict[str, float]:
    """This process's resident memory now: anonymous (heap: weights, cache, KV) and file-backed
    (the memory-mapped checkpoint's pages, which the kernel may drop)."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return {k: int(fields[k].split()[0]) / 1024 for k in ("RssAnon", "RssFile")}


def run_one(path: Path, strategy: str, cache_gb: float, weights: str, tokens: int, threads: int) -> dict[str, object]:
    """One engine, one request: the figures of one strategy (runs in its own process)."""
    import torch

    from freetoken.config import EngineConfig
    from freetoken.engine.build import build_engine
    from freetoken.models.experts import expert_status
    from freetoken.request import Request, SamplingParams

    t0 = time.perf_counter()
    config = EngineConfig(model=str(path), dtype="auto", threads=threads, num_tokens=2048, page_size=16,
                          weights=weights, moe_strategy=strategy, expert_cache_gb=cache_gb)
    engine, loaded = build_engine(config)
    load_s = time.perf_counter() - t0
    req = Request("r", [3 + (i * 37) % (VOCAB - 8) for i in range(16)],
                  SamplingParams(max_tokens=tokens + 1, temperature=0.0, ignore_eos=True))
    engine.add_request(req)
    engine.step()  # the prefill and the first token
    cpu0, wall0 = time.thread_time(), time.perf_counter()
    steps, peak_anon = 0, rss_mib()["RssAnon"]
    while not req.finished:
        engine.step()
        steps += 1
        peak_anon = max(peak_anon, rss_mib()["RssAnon"])
    cpu, wall = time.thread_time() - cpu0, time.perf_counter() - wall0
    status = expert_status(loaded.model) or {}
    return {
        "strategy": strategy, "weights": weights, "dtype": str(loaded.dtype).removeprefix("torch."), "torch_threads": torch.get_num_threads(),
        "decode_tokens": steps, "tok_s_cpu": steps / cpu, "tok_s_wall": steps / wall, "load_s": load_s,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "peak_anon_decode_mib": peak_anon,
        "file_mib_end": rss_mib()["RssFile"], "experts": status,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--intermediate", type=int, default=512)
    p.add_argument("--qtype", default="MXFP4", choices=["MXFP4", "Q8_0", "Q4_0", "Q4_1", "Q5_0"])
    p.add_argument("--cache-fraction", type=float, default=0.25, help="the cache's budget as a share of all experts' decoded bytes")
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--run", nargs=4, metavar=("FILE", "STRATEGY", "CACHE_GB", "WEIGHTS"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.run:
        path, strategy, cache_gb, weights = args.run
        print(json.dumps(run_one(Path(path), strategy, float(cache_gb), weights, args.tokens, args.threads)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "moe.gguf"
        write_model(path, args)
        size_mib = path.stat().st_size / 2**20
        results = []
        for strategy, weights in (("resident", "auto"), ("offload", "auto"), ("resident", "bf16")):
            cache_gb = 0.0
            if strategy == "offload":
                resident_bytes = results[0]["experts"]["resident_bytes"]
                cache_gb = args.cache_fraction * resident_bytes / 2**30
            cmd = [sys.executable, __file__, "--run", str(path), strategy, repr(cache_gb), weights, "--tokens",
                   str(args.tokens), "--threads", str(args.threads)]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            results.append(json.loads(out.strip().splitlines()[-1]))
    shape = (f"{args.layers} layers x {args.experts} experts (top {args.top_k}), hidden {args.hidden}, "
             f"intermediate {args.intermediate}, experts {args.qtype}; GGUF {size_mib:.0f} MiB")
    print(shape)
    for r in results:
        ex = r["experts"]
        cache = ex.get("cache") or {}
        memory = (f"experts resident {ex['resident_bytes'] / 2**20:.0f} MiB" if r["strategy"] == "resident" else
                  f"cache {cache['capacity_bytes'] / 2**20:.0f} MiB, hit rate {cache['hit_rate']:.2f} "
                  f"({cache['hits']} hits, {cache['misses']} misses, {cache['evictions']} evictions)")
        label = r["strategy"] + (" (--weights bf16: experts dequantized, the old path)" if r["weights"] == "bf16" else "")
        print(f"  {label:<8} {r['tok_s_cpu']:7.1f} tok/s (CPU time; wall {r['tok_s_wall']:.1f})  {memory}; "
              f"peak RSS {r['peak_rss_mib']:.0f} MiB (decoding: anonymous {r['peak_anon_decode_mib']:.0f} MiB, "
              f"file pages {r['file_mib_end']:.0f} MiB at the end); load {r['load_s']:.1f} s; {r['dtype']}, {r['torch_threads']} thread(s)")


if __name__ == "__main__":
    main()
