"""A greedy paged workload on a real model for tensor-parallel parity: several text prompts (two
share a prefix) prefilled in one mixed batch with every row's logits (over PREFILL_ROWS rows, so
the prefill copies run), then decoded together greedily for NEW_TOKENS tokens. Each row keeps
its TOP_SAVED best log-probabilities. Run in-process it is the TP=1 reference; run as a script it
is one rank of a TP group (rank 0 saves the result).

    python tp_greedy.py RANK WORLD PORT OUT_FILE MODEL WEIGHTS KV_CACHE_DTYPE[,KV_CACHE_DTYPE...] NEW_TOKENS
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import numpy as np
import torch

from freetoken.attention.metadata import ForwardBatch
from freetoken.kv.tensors import KVTensors
from freetoken.models.load import LoadedModel, load_model

PROMPTS = (
    "Once upon a time, in a small village,",
    "Once upon a time, in a small village, there lived a man named John. He was a",
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Water boils at 100 degrees Celsius at sea level, but on a high mountain the air pressure is lower, so",
)
NEW_TOKENS = 32  # 64 until 2026-12-07 (~100 s of a 2-core CI run for the same comparison)
TOP_SAVED = 20
P = 16  # page size
PAGES = 64


@dataclass
class Run:
    """Per forward row (prefill rows of every prompt, then one row per prompt and decode step):
    the TOP_SAVED best token ids and their log-probabilities; and each prompt's greedy tokens."""

    top_ids: torch.Tensor  # int64 [rows, TOP_SAVED]
    top_logprobs: torch.Tensor  # float32 [rows, TOP_SAVED]
    tokens: list[list[int]]


def run_greedy(loaded: LoadedModel, cache_dtype: str, new_tokens: int = NEW_TOKENS) -> Run:
    model, config = loaded.model, loaded.config
    prompts = [loaded.tokenizer.encode(text) for text in PROMPTS]
    kv = KVTensors(model.config.kv_layout(), PAGES, PAGES, P, loaded.dtype, loaded.device, cache_dtype)
    free = [int(p) for p in np.random.default_rng(0).permutation(np.arange(1, PAGES + 1))]
    tables: list[list[int]] = [[] for _ in prompts]
    lengths = [0] * len(prompts)
    work = [list(p) for p in prompts]
    tokens: list[list[int]] = [[] for _ in prompts]
    ids_out, lp_out = [], []
    for step in range(new_tokens):
        specs = []
        for r, new in enumerate(work):
            while len(tables[r]) * P < lengths[r] + len(new):
                tables[r].append(free.pop())
            table = np.array(tables[r], dtype=np.int32)
            specs.append((lengths[r], len(new), table, table if config.has_swa else None))
        batch = ForwardBatch.build(specs, P, all_logits=step == 0, sliding_window=config.sliding_window)
        with torch.inference_mode():
            logprobs = model(torch.tensor([t for new in work for t in new]), batch, kv).float().log_softmax(-1)
        top = logprobs.topk(TOP_SAVED, dim=-1)
        ids_out.append(top.indices)
        lp_out.append(top.values)
        last = np.cumsum([len(new) for new in work]) - 1 if step == 0 else np.arange(len(work))
        for r, new in enumerate(work):
            lengths[r] += len(new)
        work = [[int(logprobs[int(row)].argmax())] for row in last]
        for r, new in enumerate(work):
            tokens[r] += new
    return Run(torch.cat(ids_out), torch.cat(lp_out), tokens)


def load(model: str, weights: str, rank: int = 0, world: int = 1) -> LoadedModel:
    return load_model(model, torch.float32, torch.device("cpu"), weights, "bf16", rank=rank, world=world)


def main(argv: list[str]) -> int:
    from freetoken.distributed.group import join_group, leave_group

    rank, world, port, out = int(argv[0]), int(argv[1]), int(argv[2]), argv[3]
    model, weights, cache_dtypes, new_tokens = argv[4], argv[5], argv[6].split(","), int(argv[7])
    torch.set_num_threads(1)
    join_group(rank, world, port, torch.device("cpu"))
    loaded = load(model, weights, rank, world)
    runs = {cache: run_greedy(loaded, cache, new_tokens) for cache in cache_dtypes}
    if rank == 0:
        torch.save({cache: vars(run) for cache, run in runs.items()}, out)
    leave_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
