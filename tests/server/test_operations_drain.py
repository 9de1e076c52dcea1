"""Graceful drain of `ft serve`: SIGTERM with a stream in flight lets it finish ([DONE]) while a
new request gets 503 with Retry-After, then the server exits 0 with its engine gone;
`POST /admin/drain` (behind the API key) does the same and past `--shutdown-timeout` ends what is
left with an error; a second SIGTERM exits at once. Each test owns its server (it ends it).

The stream is held in the engine after its first token by the engine's test hold (`--test-hold`,
tests/server/hold.py), so it is certainly still in flight when the drain starts, however fast the
machine: the drain test releases it once the draining state is seen (and gives the drain a
guard-sized `--shutdown-timeout`, so the release, not the machine's speed, decides that it
finishes); the timeout test never releases it, so `--shutdown-timeout 0.5` certainly cuts it.
Deadlines are generous hang guards, nothing is timed."""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path

import httpx
from hold import EngineHold
from serving import ServeProcess, assert_clean_shutdown, pid_alive

FLAGS = ["--page-size", "4", "--num-tokens", "2048", "--max-running-requests", "2", "--dtype", "float32", "--threads", "1"]
LONG = {"model": "default", "prompt": [5, 6, 7, 8], "max_tokens": 40, "temperature": 0, "ignore_eos": True, "stream": True}
GUARD_S = 120.0


def start(model: Path, tmp_path: Path, log: str, *flags: str, api_key: str | None = None) -> tuple[ServeProcess, EngineHold]:
    """A server whose engine holds every request after its first token (until `hold.release()`)."""
    hold = EngineHold(tmp_path / "hold")
    hold.decode_after(1)
    proc = ServeProcess(str(model), [*FLAGS, *hold.flags, *flags], tmp_path / log, api_key=api_key)
    proc.wait_healthy()
    return proc, hold


class Stream(threading.Thread):
    """One long streamed completion read to its end; `started` once its first event came."""

    def __init__(self, server: ServeProcess) -> None:
        super().__init__(daemon=True)
        self.server = server
        self.events: list[str] = []
        self.started = threading.Event()

    def run(self) -> None:
        try:
            with self.server.http(GUARD_S) as c, c.stream("POST", "/v1/completions", json=LONG) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line)
                        self.started.set()
        except httpx.HTTPError as err:  # the server exited at once under it
            self.events.append(f"closed: {type(err).__name__}")
        finally:
            self.started.set()


def wait_draining(server: ServeProcess) -> bool:
    end = time.monotonic() + GUARD_S
    while time.monotonic() < end:
        if httpx.get(f"{server.base}/health", timeout=GUARD_S).json().get("state") == "draining":
            return True
        time.sleep(0.02)
    return False


def wait_exit(server: ServeProcess) -> int:
    code = server.proc.wait(timeout=GUARD_S)
    server._log.close()
    return code


def test_sigterm_drains_in_flight_then_exits_0(tiny_gemma_dir: Path, tmp_path: Path) -> None:
    server, hold = start(tiny_gemma_dir, tmp_path, "drain.log", "--shutdown-timeout", str(GUARD_S))
    try:
        server.engine_pids.add(server.wait_healthy()["pid"])
        stream = Stream(server)
        stream.start()
        assert stream.started.wait(GUARD_S)
        server.proc.send_signal(signal.SIGTERM)
        assert wait_draining(server)
        refused = httpx.post(f"{server.base}/v1/completions", json={"model": "default", "prompt": "x", "max_tokens": 2}, timeout=GUARD_S)
        health = httpx.get(f"{server.base}/health", timeout=GUARD_S)
        assert stream.is_alive() and "data: [DONE]" not in stream.events  # held: in flight through all of the above
        hold.release()
        stream.join(GUARD_S)
        code = wait_exit(server)
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
    assert refused.status_code == 503 and refused.headers["retry-after"], refused.text
    assert refused.json()["error"]["code"] == "server_draining", refused.text
    assert health.status_code == 503 and health.json()["state"] == "draining", health.text
    assert stream.events[-1] == "data: [DONE]", stream.events[-3:]
    finals = [json.loads(e[6:]) for e in stream.events[:-1] if json.loads(e[6:]).get("choices", [{}])[0].get("finish_reason")]
    assert finals and finals[-1]["choices"][0]["finish_reason"] == "length", stream.events[-3:]
    assert code == 0, server.log()
    assert_clean_shutdown(server, code)


def test_admin_drain_needs_the_key_and_ends_stragglers_at_the_timeout(tiny_gemma_dir: Path, tmp_path: Path) -> None:
    server, _ = start(tiny_gemma_dir, tmp_path, "admin.log", "--shutdown-timeout", "0.5", api_key="ops-key")  # never released
    try:
        server.engine_pids.add(server.wait_healthy()["pid"])
        assert httpx.post(f"{server.base}/admin/drain", timeout=GUARD_S).status_code == 401
        stream = Stream(server)
        stream.start()
        assert stream.started.wait(GUARD_S)
        r = httpx.post(f"{server.base}/admin/drain", headers=server.headers, timeout=GUARD_S)
        assert r.status_code == 202 and r.json()["started"] is True, r.text
        stream.join(GUARD_S)
        code = wait_exit(server)
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
    assert "data: [DONE]" not in stream.events  # cut off at --shutdown-timeout: an error event, no [DONE]
    last = json.loads(stream.events[-1][6:])
    assert "--shutdown-timeout" in last["error"]["message"], last
    assert code == 0, server.log()
    assert_clean_shutdown(server, code)


def test_second_sigterm_exits_at_once(tiny_gemma_dir: Path, tmp_path: Path) -> None:
    server, _ = start(tiny_gemma_dir, tmp_path, "twice.log")  # held: the first SIGTERM cannot finish the drain
    try:
        pid = server.wait_healthy()["pid"]
        stream = Stream(server)
        stream.start()
        assert stream.started.wait(GUARD_S)
        server.proc.send_signal(signal.SIGTERM)
        assert wait_draining(server), "the first SIGTERM did not start a drain"  # so the second is a second one
        server.proc.send_signal(signal.SIGTERM)
        code = wait_exit(server)
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
    assert code != 0, server.log()
    assert "again: exiting now" in server.log(), server.log()
    stream.join(GUARD_S)
    assert not stream.is_alive()
    end = time.monotonic() + GUARD_S
    while pid_alive(pid) and time.monotonic() < end:
        time.sleep(0.05)
    assert not pid_alive(pid), "the engine process outlived the server"
