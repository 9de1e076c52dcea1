"""Rank 0's side of a tensor-parallel engine: start ranks 1..N-1, join them, watch them, stop them.

Owns the other ranks' processes (plain subprocesses of rank 0, so the supervisor still watches one
engine process and restarting it restarts every rank), the rule that the engine lives and dies as
one unit — a rank that exits while rank 0 serves, or a forward that fails on rank 0, ends rank 0
at once with EXIT_RANK_LOST, and the supervisor sees the engine gone — and the clean stop (a STOP
broadcast, then the processes reaped) at rank 0's exit. It sits at the engine's layer; it never touches page accounting.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import logging
import os
import subprocess
import sys
import threading
from typing import NoReturn

import torch

from freetoken.config import EngineConfig
from freetoken.distributed.group import free_loopback_port, join_group, leave_group
from freetoken.distributed.step import StepSender
from freetoken.errors import EXIT_FAILED, EXIT_STARTUP
from freetoken.utils import logs

log = logging.getLogger("freetoken.engine")

# EXIT_FAILED (freetoken/errors.py): a restart may help. A rank that could not load the model
# exits with EXIT_STARTUP, which rank 0 passes on as is.
EXIT_RANK_LOST = EXIT_FAILED
STOP_WAIT_S = 10.0


class Peers:
    """Ranks 1..N-1 seen from rank 0: the step channel to them and their processes."""

    def __init__(self, procs: list[subprocess.Popen[bytes]], sender: StepSender) -> None:
        self.procs = procs
        self.sender = sender
        self.pids = [p.pid for p in procs]
        self._closing = threading.Event()
        for rank, proc in enumerate(procs, start=1):
            threading.Thread(
                target=self._watch, args=(rank, proc), name=f"freetoken-rank-{rank}-watch", daemon=True
            ).start()

    def _watch(self, rank: int, proc: subprocess.Popen[bytes]) -> None:
        code = proc.wait()
        if self._closing.is_set():
            return
        log.error(
            "tensor-parallel rank %d (pid %d) exited with code %d: the engine goes down with it", rank, proc.pid, code
        )
        os._exit(EXIT_STARTUP if code == EXIT_STARTUP else EXIT_RANK_LOST)

    def abandon(self, err: BaseException) -> NoReturn:
        """A forward failed on rank 0 part-way through its collectives: the ranks are out of step,
        so the engine ends as one unit now (the supervisor restarts every rank)."""
        log.error("a tensor-parallel step failed on rank 0 (%s: %s): the engine goes down", type(err).__name__, err)
        self._closing.set()
        os._exit(EXIT_RANK_LOST)

    def close(self) -> None:
        """Tell the ranks to stop, then reap them (killing any that do not exit). Idempotent."""
        if self._closing.is_set():
            return
        self._closing.set()
        try:
            self.sender.stop()
        except RuntimeError as err:  # a peer already gone: nothing to tell it
            log.warning("could not send STOP to the tensor-parallel ranks: %s", err)
        for proc in self.procs:
            try:
                proc.wait(STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        leave_group()


def start_peers(config: EngineConfig, device: torch.device) -> Peers:
    """Start ranks 1..N-1 of `config.tensor_parallel_size` on a free loopback port and join the
    group as rank 0 (blocks until every rank joined). Their stop is registered for this
    process's exit."""
    world = config.tensor_parallel_size
    port = free_loopback_port()
    spec = json.dumps(dataclasses.asdict(config))
    log_spec = json.dumps(dataclasses.asdict(logs.current()))  # the ranks log as the engine process does
    procs = [
        subprocess.Popen([sys.executable, "-m", "freetoken.distributed.follower", spec, str(rank), str(port), log_spec])
        for rank in range(1, world)
    ]
    peers = Peers(procs, StepSender(device))
    join_group(0, world, port, device)
    atexit.register(peers.close)
    log.info("tensor parallelism: %d ranks on 127.0.0.1:%d (rank pids %s)", world, port, peers.pids)
    return peers
