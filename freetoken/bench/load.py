"""`ft bench load`: how long a server takes from launch to its first `/health` 200, and how much
memory it holds on the way and after two short requests, beside a peer on the same file.

Each start launches the server in its own session, polls `/health` every 0.1 s, then sends two
64-token `/v1/completions` and reads the memory of every process in its tree:

- `ready_s`: launch to the first 200 (a model load, the engine process included);
- `rss_mb`: resident memory after the two requests, summed over the tree;
- `peak_mb`: the sum over the tree of each process's `VmHWM` (its own high-water mark), read just
  before the stop; a process that came and went in between is caught by the sampled peak;
- `sampled_peak_mb`: the largest tree total seen by a 0.1 s sampler (a lower bound of the true peak).

Starts alternate between the servers (FreeToken first on odd rounds, the peer first on even
ones), so a cold page cache or a busy neighbour does not always fall on one side. The first
`first_starts` of each server are reported apart (median ready time and peak), the rest as
medians. FreeToken's first starts each get an empty weight cache directory of the run's own
(they read and pack the checkpoint and write the cache: a user's first start); the later ones
map the last of them (a second start). With `--weights-cache` passed, every start uses that. Owns no server
logic: it only launches commands and reads /proc.
"""

from __future__ import annotations

import logging
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

from freetoken.utils.ports import free_port

logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per /health poll otherwise

PROMPT = "The history of the printing press begins"


def _tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def _hwm_bytes(p: psutil.Process) -> int:
    """The process's resident high-water mark (VmHWM), 0 once it is gone."""
    try:
        with open(f"/proc/{p.pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


@dataclass
class Start:
    """One launch of one server, measured."""

    label: str
    ready_s: float = 0.0
    rss_mb: float = 0.0
    peak_mb: float = 0.0
    sampled_peak_mb: float = 0.0
    hwm: dict[int, int] = field(default_factory=dict)  # pid -> VmHWM bytes seen so far


def measure(label: str, cmd: list[str], port: int, timeout_s: float, log: Path) -> Start:
    """Launch `cmd` (which must listen on `port`), time it to ready, send two requests, stop it."""
    start = Start(label)
    stopping = threading.Event()
    with open(log, "w") as out:
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

        def sample() -> None:
            while not stopping.wait(0.1):
                total = 0
                for p in _tree(proc.pid):
                    try:
                        total += p.memory_info().rss
                    except psutil.Error:
                        continue
                    start.hwm[p.pid] = max(start.hwm.get(p.pid, 0), _hwm_bytes(p))
                start.sampled_peak_mb = max(start.sampled_peak_mb, total / 2**20)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        base = f"http://127.0.0.1:{port}"
        try:
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"{label} exited with {proc.returncode} before it was ready; see {log}")
                if time.monotonic() - t0 > timeout_s:
                    raise RuntimeError(f"{label} not ready after {timeout_s:.0f} s; see {log}")
                try:
                    if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.1)
            start.ready_s = time.monotonic() - t0
            models = httpx.get(f"{base}/v1/models", timeout=60).json().get("data") or [{"id": "default"}]
            for _ in range(2):
                body = {"prompt": PROMPT, "max_tokens": 64, "temperature": 0, "model": models[0]["id"]}
                httpx.post(f"{base}/v1/completions", json=body, timeout=600).raise_for_status()
            procs = _tree(proc.pid)
            start.rss_mb = sum(p.memory_info().rss for p in procs) / 2**20
            for p in procs:
                start.hwm[p.pid] = max(start.hwm.get(p.pid, 0), _hwm_bytes(p))
            start.peak_mb = sum(start.hwm.values()) / 2**20
        finally:
            stopping.set()
            sampler.join()
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
    return start


def ft_command(model: str, threads: int, num_tokens: int, port: int, extra: list[str]) -> list[str]:
    ft = shutil.which("ft")
    head = [ft] if ft else [sys.executable, "-m", "freetoken.cli"]
    return [
        *head,
        "serve",
        "--model",
        model,
        "--threads",
        str(threads),
        "--num-tokens",
        str(num_tokens),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *extra,
    ]


def peer_command(binary: str, model: str, threads: int, num_tokens: int, port: int) -> list[str]:
    return [
        binary,
        "-m",
        model,
        "-t",
        str(threads),
        "-tb",
        str(threads),
        "-c",
        str(num_tokens),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]


def run(
    model: str,
    peer: str | None,
    starts: int,
    threads: int,
    num_tokens: int,
    timeout_s: float,
    ft_extra: list[str],
    first_starts: int = 1,
) -> list[Start]:
    """`starts` launches of FreeToken (and of the peer binary, alternating), in order; the first
    `first_starts` of FreeToken's with an empty weight cache each."""
    logs = Path(tempfile.mkdtemp(prefix="ft-bench-load-"))
    own_cache = "--weights-cache" not in ft_extra
    results: list[Start] = []
    try:
        for i in range(starts):
            order = ["freetoken", "peer"] if i % 2 == 0 else ["peer", "freetoken"]
            for label in order:
                if label == "peer" and peer is None:
                    continue
                port = free_port()
                cache = logs / f"weights-cache-{min(i, first_starts - 1)}"
                extra = [*ft_extra, "--weights-cache", str(cache)] if own_cache else ft_extra
                cmd = (
                    ft_command(model, threads, num_tokens, port, extra)
                    if label == "freetoken"
                    else peer_command(str(peer), model, threads, num_tokens, port)
                )
                print(f"ft bench load: start {i + 1}: {shlex.join(cmd)}", file=sys.stderr, flush=True)
                results.append(measure(label, cmd, port, timeout_s, logs / f"{label}-{i}.log"))
    finally:
        # The weight caches it made are a copy of the model each (GBs); the logs stay.
        for cache in logs.glob("weights-cache-*"):
            shutil.rmtree(cache, ignore_errors=True)
        print(f"ft bench load: logs in {logs}", file=sys.stderr, flush=True)
    return results


def table(results: list[Start], first_starts: int = 1) -> str:
    """The first `first_starts` starts (their median) and the median of the later ones, per
    server; ratios FreeToken / peer."""
    labels = list(dict.fromkeys(r.label for r in results))
    rows: dict[str, dict[str, float]] = {}
    of = "" if first_starts == 1 else f", median of {first_starts}"
    for label in labels:
        mine = [r for r in results if r.label == label]
        first, later = mine[:first_starts], mine[first_starts:] or mine
        rows[label] = {
            f"first start, ready (s{of})": statistics.median(r.ready_s for r in first),
            f"first start, peak VmHWM (MiB{of})": statistics.median(r.peak_mb for r in first),
            "later starts, ready (s, median)": statistics.median(r.ready_s for r in later),
            "RSS after two requests (MiB, median)": statistics.median(r.rss_mb for r in mine),
            "peak, sum of VmHWM (MiB, median)": statistics.median(r.peak_mb for r in mine),
            "peak, sampled (MiB, median)": statistics.median(r.sampled_peak_mb for r in mine),
        }
    head = "| measure | " + " | ".join(labels) + (" | ratio |" if len(labels) == 2 else " |")
    lines = [head, "|---" * (len(labels) + 1 + (len(labels) == 2)) + "|"]
    for key in rows[labels[0]]:
        values = [rows[label][key] for label in labels]
        cells = " | ".join(f"{v:.1f}" for v in values)
        ratio = f" | {values[0] / values[1]:.2f}x" if len(values) == 2 and values[1] else ""
        lines.append(f"| {key} | {cells}{ratio} |")
    return "\n".join(lines)
