"""The main of a tensor-parallel rank other than 0: load its shard, then run every step rank 0 sends.

Owns a follower rank's life: join the group, load the model's shard, allocate its own K/V
tensors (its KV heads, the pool sizes rank 0 broadcasts, the `--kv-cache-dtype` every rank
shares), report what it built to rank 0 (`report`: rank 0 refuses a mismatch), then forward each
step it receives until STOP. It keeps no page accounting: the page tables come with each step. It exits when its
parent (rank 0) is gone, and a failure ends the process, which ends the engine (`launch`).

    python -m freetoken.distributed.follower '<EngineConfig as JSON>' RANK PORT
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time

import torch

from freetoken.config import EngineConfig
from freetoken.distributed.group import join_group, leave_group, rank_device, rank_threads
from freetoken.distributed.report import RankReport, exchange
from freetoken.distributed.step import receive_pools, receive_step
from freetoken.errors import EXIT_STARTUP, FreeTokenError
from freetoken.kv.tensors import KVTensors
from freetoken.models.forward import build_batch, run_model
from freetoken.models.load import load_model
from freetoken.utils import logs
from freetoken.utils.hardware import default_device, resolve_dtype

log = logging.getLogger("freetoken.engine")

PARENT_POLL_S = 0.5


def _exit_with_parent(parent: int) -> None:
    while True:
        time.sleep(PARENT_POLL_S)
        if os.getppid() != parent:
            os._exit(1)


def run_follower(config: EngineConfig, rank: int, port: int, log_settings: logs.LogSettings | None = None) -> int:
    logs.configure(log_settings or logs.LogSettings(), f"rank{rank}")
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    torch.set_num_threads(rank_threads(config))
    device = rank_device(torch.device(config.device) if config.device else default_device(), rank)
    dtype = resolve_dtype(config.dtype, device)
    join_group(rank, config.tensor_parallel_size, port, device)
    try:
        loaded = load_model(
            config.model,
            dtype,
            device,
            config.weights,
            config.copies_for_prefill,
            rank=rank,
            world=config.tensor_parallel_size,
            moe_strategy=config.moe_strategy,
            expert_cache_gb=config.expert_cache_gb,
        )
    except FreeTokenError as err:
        log.error("rank %d cannot load the model: %s", rank, err)
        return EXIT_STARTUP
    full, swa, page_size = receive_pools(device)
    kv = KVTensors(loaded.model.config.kv_layout(), full, swa, page_size, dtype, device, config.kv_cache_dtype)
    exchange(RankReport(rank, loaded.formats, kv.nbytes, str(kv.dtype).removeprefix("torch.")))  # rank 0 checks it
    with torch.inference_mode():
        while (step := receive_step(device)) is not None:
            batch = build_batch(loaded.config, kv, step.specs, step.logit_rows, alone_max=config.alone_max)
            run_model(loaded.model, kv, step.ids, batch)
    leave_group()
    return 0


if __name__ == "__main__":
    fields = json.loads(sys.argv[1])
    settings = logs.LogSettings(**json.loads(sys.argv[4])) if len(sys.argv) > 4 else None
    sys.exit(run_follower(EngineConfig(**fields), int(sys.argv[2]), int(sys.argv[3]), settings))
