"""A fixed paged workload for tensor-parallel parity: two requests prefilled in one mixed batch
(every row's logits), then decoded together step by step over shuffled pages. Run in-process it
is the TP=1 reference; run as a script it is one rank of a TP group (rank 0 saves the logits).

    python tp_script.py RANK WORLD PORT OUT_DIR NAME=DIR[:POLICY[:KV_CACHE_DTYPE]] ...
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

from freetoken.attention.metadata import ForwardBatch
from freetoken.kv.tensors import KVTensors
from freetoken.models.load import LoadedModel, load_model

P = 4  # page size
PROMPTS = ([(7 * i + 3) % 290 + 5 for i in range(19)], [(11 * i + 1) % 290 + 5 for i in range(11)])
DECODE_STEPS = 6


def run_script(loaded: LoadedModel, cache_dtype: str = "auto") -> list[torch.Tensor]:
    """Logits of every step: prefill rows of both prompts, then one row per request per step."""
    model = loaded.model
    kv = KVTensors(model.config.kv_layout(), 48, 48, P, torch.float32, "cpu", cache_dtype)
    free = [int(p) for p in np.random.default_rng(0).permutation(np.arange(1, 49))]
    tables: list[list[int]] = [[], []]
    lengths = [0, 0]
    out = []
    work = [list(p) for p in PROMPTS]
    for step in range(DECODE_STEPS + 1):
        specs = []
        for r, new in enumerate(work):
            while len(tables[r]) * P < lengths[r] + len(new):
                tables[r].append(free.pop())
            table = np.array(tables[r], dtype=np.int32)
            specs.append((lengths[r], len(new), table, table if loaded.config.has_swa else None))
        batch = ForwardBatch.build(specs, P, all_logits=step == 0, sliding_window=loaded.config.sliding_window)
        ids = torch.tensor([t for new in work for t in new])
        with torch.inference_mode():
            out.append(model(ids, batch, kv).float())
        for r, new in enumerate(work):
            lengths[r] += len(new)
        work = [[(31 * step + 17 * r) % 290 + 5] for r in range(2)]  # fixed next tokens, not sampled
    return out


def cache_dtype(spec: str) -> str:
    """The K/V cache dtype a spec names (`auto` unless it has a third field)."""
    fields = spec.partition("=")[2].split(":")
    return fields[2] if len(fields) > 2 else "auto"


def load(spec: str, rank: int = 0, world: int = 1) -> tuple[str, LoadedModel]:
    name, _, rest = spec.partition("=")
    directory, _, policy = rest.partition(":")
    policy = policy.partition(":")[0]
    return name, load_model(directory, torch.float32, torch.device("cpu"), policy or "bf16", rank=rank, world=world)


def main(argv: list[str]) -> int:
    from freetoken.distributed.group import join_group, leave_group

    rank, world, port, out_dir = int(argv[0]), int(argv[1]), int(argv[2]), Path(argv[3])
    torch.set_num_threads(1)
    join_group(rank, world, port, torch.device("cpu"))
    for spec in argv[4:]:
        name, loaded = load(spec, rank, world)
        logits = run_script(loaded, cache_dtype(spec))
        if rank == 0:
            torch.save(logits, out_dir / f"{name}.pt")
    leave_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
