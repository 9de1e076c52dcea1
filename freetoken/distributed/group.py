"""Joining one rank to the tensor-parallel process group on a loopback rendezvous.

Owns the backend choice (gloo on CPU, nccl on CUDA), the device and threads of a rank, the rendezvous port
(a free loopback port rank 0 picks) and the collective timeout. It starts no process.
"""

from __future__ import annotations

import socket
from datetime import timedelta

import torch
import torch.distributed as dist

from freetoken.config import EngineConfig
from freetoken.utils.hardware import default_threads

# An idle engine waits in a broadcast for its next step for as long as nobody sends one; a dead
# peer is seen when its sockets close, not by this timeout.
COLLECTIVE_TIMEOUT = timedelta(days=30)


def free_loopback_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rank_threads(config: EngineConfig) -> int:
    """torch threads of one rank: --threads, or by default the cores shared out among the ranks
    (at world size 1, all of them, as without tensor parallelism)."""
    return config.threads or max(1, default_threads() // config.tensor_parallel_size)


def rank_device(device: torch.device, rank: int) -> torch.device:
    """CUDA ranks get one device each; CPU ranks share the CPU."""
    return torch.device("cuda", rank) if device.type == "cuda" else device


def join_group(rank: int, world: int, port: int, device: torch.device) -> None:
    """Block until all `world` ranks met at 127.0.0.1:`port` (rank 0 hosts the store)."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=COLLECTIVE_TIMEOUT
    )


def leave_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
