"""A hung engine under `ft serve --engine-hang-timeout 8`: SIGSTOP freezes the engine process
mid-stream (no beat can leave it), so `/health` turns 503 naming the missed heartbeat, the
in-flight stream ends with an error event (no [DONE]), the supervisor kills the frozen process
and a new engine serves. And the converse: a step that runs longer than the hang timeout, with
the engine alive, is not a hang.

Nothing depends on the machine's speed: the stream is held in the engine after its first token
(`--test-hold`, tests/server/hold.py), so it is in flight at the SIGSTOP; the respawned engine is
frozen the moment it is spawned (`RespawnFreezer`), so the 503 is certainly there to be read; and
the long step is a step held at its start until the server has logged that it ran past the hang
timeout with the heartbeat going on. Deadlines are generous hang guards, nothing is timed."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from hold import EngineHold
from procs import RespawnFreezer
from serving import ServeProcess, pid_alive, serving

HANG_TIMEOUT_S = 8.0  # well above the beat gaps a loaded 2-core machine shows
GUARD_S = 60.0
ALIVE_LOG = "the engine is alive: its heartbeat goes on"  # the API process's line for a long step


@pytest.fixture(scope="module")
def hang_hold(tmp_path_factory: pytest.TempPathFactory) -> EngineHold:
    return EngineHold(tmp_path_factory.mktemp("hang_hold") / "hold")


@pytest.fixture(scope="module")
def hang_server(tiny_gemma_dir: Path, hang_hold: EngineHold, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    flags = ["--page-size", "4", "--num-tokens", "2048", "--max-running-requests", "2", "--dtype", "float32", "--threads", "1",
             "--engine-hang-timeout", str(HANG_TIMEOUT_S), *hang_hold.flags]
    with serving(str(tiny_gemma_dir), flags, tmp_path_factory.mktemp("hang_logs") / "hang.log") as proc:
        yield proc


def metric(server: ServeProcess, name: str) -> float:
    text = httpx.get(f"{server.base}/metrics", timeout=30).text
    return next(float(line.split()[1]) for line in text.splitlines() if line.startswith(name + " "))


@pytest.mark.expects_engine_restart
def test_sigstopped_engine_is_detected_killed_and_replaced(hang_server: ServeProcess, hang_hold: EngineHold) -> None:
    healthy = hang_server.wait_healthy()
    pid, restarts = healthy["pid"], healthy["restarts"]
    body = {"model": "default", "prompt": [5, 6, 7, 8], "max_tokens": 100, "temperature": 0, "ignore_eos": True, "stream": True}
    events: list[str] = []
    hang_hold.decode_after(1)
    freezer = RespawnFreezer(hang_server.proc.pid)
    freezer.start()
    try:
        with httpx.Client(base_url=hang_server.base, timeout=GUARD_S) as c, c.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            for line in lines:
                if line.startswith("data: "):
                    events.append(line)
                    break
            os.kill(pid, signal.SIGSTOP)  # the stream is held after its first token: still in flight
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
        # The respawned engine is frozen until the test resumes it: the server is certainly down.
        assert freezer.caught.wait(GUARD_S), f"the supervisor never spawned a new engine:\n{hang_server.log()}"
        down = httpx.get(f"{hang_server.base}/health", timeout=30)
    finally:
        freezer.resume()
        hang_hold.release()
    assert "data: [DONE]" not in events
    last = json.loads(events[-1][6:])
    assert "heartbeat" in last["error"]["message"], last
    assert health.status_code == 503, health.text
    assert "heartbeat" in health.json()["message"] or "restarting" in health.json()["message"], health.text
    assert down.status_code == 503 and down.json()["status"] == "error" and down.json()["message"], down.text
    deadline = time.monotonic() + GUARD_S
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not pid_alive(pid), "the hung engine process was not killed"
    back = hang_server.wait_healthy()
    assert back["pid"] != pid and back["restarts"] == restarts + 1, back
    assert freezer.frozen is not None and freezer.frozen.pid == back["pid"], "the frozen child was not the new engine"
    hang_server.engine_pids.add(back["pid"])
    assert metric(hang_server, "freetoken_engine_hangs") >= 1
    r = httpx.post(f"{hang_server.base}/v1/completions", json={"model": "default", "prompt": "back", "max_tokens": 3}, timeout=GUARD_S)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1, r.text
    assert "stopped answering: no heartbeat" in hang_server.log()


def test_a_step_longer_than_the_hang_timeout_is_not_a_hang(hang_server: ServeProcess, hang_hold: EngineHold) -> None:
    """A step held at its start until the API process has logged that it ran for the hang
    timeout with beats still coming: the engine is not killed, and the request then completes."""
    healthy = hang_server.wait_healthy()
    body = {"model": "default", "prompt": [3 + i % 300 for i in range(40)], "max_tokens": 20, "temperature": 0, "ignore_eos": True}
    results: list[httpx.Response] = []
    seen = hang_server.log_path.read_text(errors="replace").count(ALIVE_LOG)
    hang_hold.step()
    request = threading.Thread(
        target=lambda: results.append(httpx.post(f"{hang_server.base}/v1/completions", json=body, timeout=10 * GUARD_S)), daemon=True,
    )
    try:
        request.start()
        deadline = time.monotonic() + 10 * GUARD_S
        while hang_server.log_path.read_text(errors="replace").count(ALIVE_LOG) == seen and time.monotonic() < deadline:
            time.sleep(0.2)
        assert hang_server.log_path.read_text(errors="replace").count(ALIVE_LOG) > seen, hang_server.log()
        during = httpx.get(f"{hang_server.base}/health", timeout=30)
        assert request.is_alive()  # the held step has not run: the request is still waiting for it
    finally:
        hang_hold.release()
    request.join(10 * GUARD_S)
    assert during.status_code == 200 and (during.json()["pid"], during.json()["restarts"]) == (healthy["pid"], healthy["restarts"])
    [r] = results
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 20, r.text
    after = hang_server.wait_healthy()
    assert (after["pid"], after["restarts"]) == (healthy["pid"], healthy["restarts"])
