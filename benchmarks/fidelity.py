"""Greedy token agreement with transformers: FreeToken and llama-server on the same GGUF.

    python benchmarks/fidelity.py [--models gemma3-270m smollm2-135m-instruct] [--tokens 32]
                                  [--llama-server PATH] [--threads 2] [--out fidelity.json]

The reference is transformers (float32) on the same file, dequantized by transformers' own GGUF
reader, so every engine is compared with the file's exact weights in exact-ish arithmetic. For 24
fixed prompts (the same token ids for everyone: FreeToken's tokenizer of the file), each engine
continues greedily for `--tokens` tokens, EOS ignored; reported per engine: the prompts whose
continuation equals the reference token for token, and the mean length of the common prefix.
Engines: FreeToken in-process with `--weights auto` (the default: quantized weights, bf16
activations rounded to int8 per 32 in the matmuls) and `--weights bf16`, and llama-server (its own
quantized dot products; activations rounded to 8 bits per block as well) over HTTP.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import torch

PROMPTS = [
    "The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
    "The three laws of thermodynamics are", "import numpy as np\n", "Translate to French: I like apples.",
    "The quick brown fox", "Q: What is 12 times 7?\nA:", "List three colors:", "In 1969, the first humans",
    "The best way to learn a language is", "SELECT name FROM users WHERE", "Photosynthesis is the process",
    "My favourite recipe for bread", "The stock market today", "function add(a, b) {",
    "Dear Sir or Madam,\n", "The mitochondria is", "Water boils at", "A haiku about autumn:\n",
    "The difference between a list and a tuple in Python is", "Mount Everest is located in",
    "To install the package, run", "The meaning of life is",
]


def _peer() -> object:
    spec = importlib.util.spec_from_file_location("bench_peer", Path(__file__).resolve().parent / "peer.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def reference(path: Path, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, torch_dtype=torch.float32)
    model.eval()
    out = []
    with torch.no_grad():
        for ids in prompts:
            x = torch.tensor([ids])
            y = model.generate(x, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
            out.append(y[0, len(ids):].tolist())
    return out


def freetoken(path: Path, prompts: list[list[int]], tokens: int, weights: str) -> list[list[int]]:
    from freetoken.llm import LLM
    from freetoken.request import SamplingParams

    llm = LLM(str(path), weights=weights, num_tokens=8192, prefill_weights="quantized")
    outs = llm.generate(prompts, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))  # type: ignore[arg-type]
    return [o.token_ids for o in outs]


def llama_server(binary: Path, path: Path, prompts: list[list[int]], tokens: int, threads: int) -> list[list[int]]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([str(binary), "-m", str(path), "-t", str(threads), "-c", "4096", "--host", "127.0.0.1",
                             "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(600):
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        out = []
        for ids in prompts:
            r = httpx.post(url + "/completion", timeout=300, json={
                "prompt": ids, "n_predict": tokens, "temperature": 0, "top_k": 1, "ignore_eos": True,
                "cache_prompt": False, "return_tokens": True})
            r.raise_for_status()
            out.append(r.json()["tokens"])
        return out
    finally:
        proc.terminate()
        proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["gemma3-270m", "smollm2-135m-instruct"])
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--llama-server", type=Path, help="default: build it as benchmarks/peer.py does")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    peer = _peer()
    binary = args.llama_server or peer.build_llama_server(peer.DEFAULT_CACHE)  # type: ignore[attr-defined]
    from freetoken.models.load import load_tokenizer
    from freetoken.weights.loader import resolve_model
    from freetoken.weights.gguf_metadata import metadata_of, open_gguf

    results = {}
    for name in args.models:
        source = resolve_model(name)
        path = Path(source.path)
        tokenizer = load_tokenizer(source, metadata_of(open_gguf(path)))
        prompts = [tokenizer.encode(p) for p in PROMPTS]
        ref = reference(path, prompts, args.tokens)
        engines = {"ft --weights auto": freetoken(path, prompts, args.tokens, "auto"),
                   "ft --weights bf16": freetoken(path, prompts, args.tokens, "bf16"),
                   "llama-server": llama_server(binary, path, prompts, args.tokens, args.threads)}
        rows = {}
        for engine, outs in engines.items():
            prefixes = [common_prefix(o, r) for o, r in zip(outs, ref)]
            rows[engine] = {"equal": sum(p == args.tokens for p in prefixes), "prompts": len(prompts),
                            "mean_common_prefix": sum(prefixes) / len(prefixes)}
        results[name] = rows
        print(f"\n{name} ({path.name}), {len(prompts)} prompts x {args.tokens} greedy tokens vs transformers float32:")
        print("| engine | continuations equal | mean common prefix, tokens |\n|---|---|---|")
        for engine, row in rows.items():
            print(f"| {engine} | {row['equal']}/{row['prompts']} | {row['mean_common_prefix']:.1f} |")
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    sys.exit(main())
