"""The disk tier under `ft serve` (`--kv-disk-dir`): a conversation's prefix survives an engine
SIGKILL (the supervisor's new engine reads the index and loads it) and a SIGTERM of the whole
server (a new server over the same directory), on the tiny sliding-window model.

No timing: each restart waits for the status document's write backlog to be empty first (what a
SIGKILL would lose otherwise is the backlog, by design), and the hits are read from the usage
report (`cached_tokens`) and `/metrics`."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import pytest
from serving import ServeProcess, serving

MODEL = "tiny-gemma"
PAGE = 4


def flags(disk: Path) -> list[str]:
    return [
        "--page-size", str(PAGE), "--num-tokens", "2048", "--max-running-requests", "2", "--max-prefill-length", "16",
        "--dtype", "float32", "--threads", "1", "--enable-cache-report", "--debug-kv",
        "--kv-disk-dir", str(disk), "--kv-disk-load", "always",
    ]  # fmt: skip


def ask(server: ServeProcess, prompt: list[int]) -> int:
    """One greedy completion; its cached prompt tokens."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{server.base}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


def written(server: ServeProcess) -> dict:  # type: ignore[type-arg]
    """The disk section once the writer has caught up."""
    end = time.monotonic() + 60
    disk = server.cache_status()["disk"]
    while disk["write_backlog"] and time.monotonic() < end:
        time.sleep(0.1)
        disk = server.cache_status()["disk"]
    assert disk["write_backlog"] == 0 and disk["entries"] > 0, disk
    return disk


def metric(server: ServeProcess, name: str) -> float:
    text = httpx.get(f"{server.base}/metrics", timeout=30).text
    return next(float(line.split()[1]) for line in text.splitlines() if line.startswith(f"{name} "))


def ids(seed: int, n: int) -> list[int]:
    return [5 + (seed * 31 + i * 7) % 200 for i in range(n)]


@pytest.mark.expects_engine_restart
def test_a_conversation_hits_from_disk_after_a_sigkill_and_a_sigterm(tiny_gemma_dir: Path, tmp_path: Path) -> None:
    disk = tmp_path / "kv-disk"
    turn1 = ids(1, 61)
    turn2 = turn1 + ids(2, 9)
    turn3 = turn2 + ids(3, 7)
    with serving(str(tiny_gemma_dir), flags(disk), tmp_path / "first.log") as server:
        first = server.wait_healthy()
        assert ask(server, turn1) == 0
        written(server)
        os.kill(first["pid"], signal.SIGKILL)
        deadline = time.monotonic() + 240
        health = server.wait_healthy()
        while health["pid"] == first["pid"] and time.monotonic() < deadline:
            time.sleep(0.2)
            health = server.wait_healthy()
        assert health["pid"] != first["pid"] and health["restarts"] == first["restarts"] + 1
        assert ask(server, turn2) >= 0.9 * len(turn1)  # the new engine's pools were empty
        assert metric(server, "freetoken_kv_disk_hits") == 1
        server.account()  # this test expected the restart
    # `serving` stopped it with SIGTERM (a clean shutdown, its backlog written); a new server:
    with serving(str(tiny_gemma_dir), flags(disk), tmp_path / "second.log") as server:
        assert server.cache_status()["disk"]["entries"] > 0
        assert ask(server, turn3) >= 0.9 * len(turn2)
        assert metric(server, "freetoken_kv_disk_hits") == 1
        assert metric(server, "freetoken_kv_disk_loaded_tokens") > 0
