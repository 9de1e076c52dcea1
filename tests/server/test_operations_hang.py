"""A hung engine under `ft serve --engine-hang-timeout 8`: SIGSTOP freezes the engine process
mid-stream (no beat can leave it), so `/health` turns 503 naming the missed heartbeat, the
in-flight stream ends with an error event (no [DONE]), the supervisor kills the frozen process
and a new engine serves. Deadlines are generous hang guards, nothing is timed."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from serving import ServeProcess, pid_alive, serving

HANG_TIMEOUT_S = 8.0  # well above the beat gaps a loaded 2-core machine shows
GUARD_S = 60.0


@pytest.fixture(scope="module")
def hang_server(tiny_gemma_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    flags = ["--page-size", "4", "--num-tokens", "2048", "--max-running-requests", "2", "--dtype", "float32", "--threads", "1",
             "--engine-hang-timeout", str(HANG_TIMEOUT_S)]
    with serving(str(tiny_gemma_dir), flags, tmp_path_factory.mktemp("hang_logs") / "hang.log") as proc:
        yield proc


def metric(server: ServeProcess, name: str) -> float:
    text = httpx.get(f"{server.base}/metrics", timeout=30).text
    return next(float(line.split()[1]) for line in text.splitlines() if line.startswith(name + " "))


def test_sigstopped_engine_is_detected_killed_and_replaced(hang_server: ServeProcess) -> None:
    healthy = hang_server.wait_healthy()
    pid, restarts = healthy["pid"], healthy["restarts"]
    body = {"model": "default", "prompt": [5, 6, 7, 8], "max_tokens": 1000, "temperature": 0, "ignore_eos": True, "stream": True}
    events: list[str] = []
    with httpx.Client(base_url=hang_server.base, timeout=GUARD_S) as c, c.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data: "):
                events.append(line)
                break
        os.kill(pid, signal.SIGSTOP)
        try:
            try:
                for line in lines:  # must end with an error once the heartbeat is missed, not hang
                    if line.startswith("data: "):
                        events.append(line)
            except httpx.ReadTimeout:
                raise AssertionError(f"the stream hung after SIGSTOP:\n{hang_server.log()}") from None
            deadline = time.monotonic() + GUARD_S
            health = httpx.get(f"{hang_server.base}/health", timeout=30)
            while health.status_code == 200 and health.json()["pid"] == pid and time.monotonic() < deadline:
                time.sleep(0.1)
                health = httpx.get(f"{hang_server.base}/health", timeout=30)
        finally:
            if pid_alive(pid):
                os.kill(pid, signal.SIGCONT)  # only if the server did not kill it (the test then fails below)
    assert "data: [DONE]" not in events
    last = json.loads(events[-1][6:])
    assert "heartbeat" in last["error"]["message"], last
    if health.status_code == 503:  # caught while down: the reason names the missed heartbeat
        assert "heartbeat" in health.json()["message"] or "restarting" in health.json()["message"], health.text
    deadline = time.monotonic() + GUARD_S
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not pid_alive(pid), "the hung engine process was not killed"
    back = hang_server.wait_healthy()
    assert back["pid"] != pid and back["restarts"] == restarts + 1, back
    hang_server.engine_pids.add(back["pid"])
    assert metric(hang_server, "freetoken_engine_hangs") >= 1
    r = httpx.post(f"{hang_server.base}/v1/completions", json={"model": "default", "prompt": "back", "max_tokens": 3}, timeout=GUARD_S)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1, r.text
    assert "stopped answering: no heartbeat" in hang_server.log()


def test_a_busy_engine_keeps_its_heartbeat(hang_server: ServeProcess) -> None:
    """Long prefill steps (a 900-token prompt in one chunk) and decoding never look like a hang."""
    healthy = hang_server.wait_healthy()
    body = {"model": "default", "prompt": [3 + i % 300 for i in range(900)], "max_tokens": 100, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{hang_server.base}/v1/completions", json=body, timeout=GUARD_S)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 100, r.text
    after = hang_server.wait_healthy()
    assert (after["pid"], after["restarts"]) == (healthy["pid"], healthy["restarts"])
