"""Start a real `ft serve` subprocess on a free port of 127.0.0.1 for a test module, and poll it.

Owns `ServeProcess` (launch, wait until /health is 200, stop with SIGTERM, log on failure) and the
idle-balance check of `/v1/cache/status`. A server shared by many tests is judged per test: the
conftest marks each test's start (`begin_test`), and after the test `assert_balanced_idle`
compares with that mark (no new violation, no restart), so one failure does not spread into later
tests and no test depends on which ran before it. What no test answered for -- a restart or a
violation between tests, or in a fixture -- is caught by `assert_accounted`, which the conftest
runs after every module and `serving` at the server's end. Deadlines are generous hang guards and
nothing is timed.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from freetoken.utils.ports import free_port

READY_DEADLINE_S = 240.0
IDLE_DEADLINE_S = 120.0


@dataclass(frozen=True)
class TestMark:
    """The engine a test started with: a restart or a new violation after it is that test's."""

    pid: int
    restarts: int
    violations: int


class ServeProcess:
    def __init__(self, model: str, args: list[str], log_path: Path, api_key: str | None = None) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.log_path = log_path
        cmd = [sys.executable, "-m", "freetoken.cli", "serve", "--model", model, "--port", str(self.port), *args]
        if api_key is not None:
            cmd += ["--api-key", api_key]
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.engine_pids: set[int] = set()  # every engine pid /health reported
        self.mark: TestMark | None = None  # set by begin_test
        # (restarts, violations) as of the last test that answered for them (passed its check, or
        # failed, or expected a restart); a change no test answered for is noted in `unaccounted`.
        self.accounted: tuple[int, int] = (0, 0)
        self.unaccounted: list[str] = []
        self.guarded = False  # the conftest's per-test guard has judged tests on this server
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, cwd=Path(__file__).resolve().parents[2])

    @property
    def headers(self) -> dict[str, str]:
        return {} if self.api_key is None else {"Authorization": f"Bearer {self.api_key}"}

    def http(self, timeout: float = 120.0) -> httpx.Client:
        return httpx.Client(base_url=self.base, headers=self.headers, timeout=timeout)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:]

    def wait_healthy(self, deadline_s: float = READY_DEADLINE_S) -> dict[str, Any]:
        end = time.monotonic() + deadline_s
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ft serve exited with {self.proc.returncode}:\n{self.log()}")
            try:
                r = httpx.get(f"{self.base}/health", timeout=5)
                if r.status_code == 200:
                    self.engine_pids.add(r.json()["pid"])
                    return r.json()
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"ft serve did not become healthy in {deadline_s} s:\n{self.log()}")

    def cache_status(self) -> dict[str, Any]:
        r = httpx.get(f"{self.base}/v1/cache/status", headers=self.headers, timeout=30)
        assert r.status_code == 200, r.text
        return r.json()

    def wait_idle(self) -> dict[str, Any]:
        """The cache status once nothing is in flight and no page is held by a request."""
        end = time.monotonic() + IDLE_DEADLINE_S
        status = self.cache_status()
        while time.monotonic() < end:
            status = self.cache_status()
            if status["engine"]["in_flight"] == 0 and all(p["in_use"] == 0 for p in status["pools"].values()):
                return status
            time.sleep(0.2)
        raise AssertionError(f"not idle after {IDLE_DEADLINE_S} s: {status}")

    def begin_test(self, name: str = "a test") -> TestMark:
        """Record the engine's pid, restart count and violation count at a test's start; a change
        since the last accounted test is noted as unaccounted (it happened between tests)."""
        self.wait_healthy()
        status = self.cache_status()
        self.mark = TestMark(status["engine"]["pid"], status["engine"]["restarts"], status["integrity"]["violations"])
        now = (self.mark.restarts, self.mark.violations)
        if self.guarded and now != self.accounted:
            self.unaccounted.append(f"before {name}: (restarts, violations) went {self.accounted} -> {now}")
        self.accounted = now
        return self.mark

    def account(self) -> None:
        """This test answers for whatever happened during it (it failed, or expected it)."""
        try:
            status = self.wait_healthy()
            integrity = self.cache_status()["integrity"]
        except (RuntimeError, AssertionError, httpx.HTTPError):
            return  # the server itself is gone: its end says so
        self.accounted = (status["restarts"], integrity["violations"])

    def assert_accounted(self) -> None:
        """No restart and no audit violation that no test answered for, and balanced idle pools."""
        assert not self.unaccounted, f"the engine restarted or failed an audit between tests: {self.unaccounted}\n{self.log()}"
        status = self.wait_idle()
        now = (status["engine"]["restarts"], status["integrity"]["violations"])
        assert now == self.accounted, (
            f"(restarts, violations) is {now}, but the tests answered for {self.accounted}: "
            f"something after the last test restarted the engine or failed an audit\n{self.log()}"
        )
        assert_pools_balanced(status)

    def assert_balanced_idle(self) -> dict[str, Any]:
        """Wait until idle, then: the same engine as at this test's start, no violation since,
        and every pool balanced. Returns the status."""
        status = self.wait_idle()
        mark = self.mark or TestMark(status["engine"]["pid"], status["engine"]["restarts"], 0)
        assert (status["engine"]["pid"], status["engine"]["restarts"]) == (mark.pid, mark.restarts), (
            f"the engine restarted during this test: {status['engine']}\n{self.log()}"
        )
        assert status["integrity"]["violations"] == mark.violations, status["integrity"]
        assert_pools_balanced(status)
        self.accounted = (mark.restarts, mark.violations)
        return status

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()
        return int(self.proc.returncode)


def pid_alive(pid: int) -> bool:
    """True while `pid` runs (a zombie counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def assert_balanced_idle(status: dict[str, Any]) -> None:
    """DESIGN.md §4 on a server's whole life: no audit violation ever, every pool balanced and
    nothing in use. For a server shared by several tests use `ServeProcess.assert_balanced_idle`."""
    assert status["integrity"]["violations"] == 0, status
    assert status["integrity"]["ok"] is True, status
    assert_pools_balanced(status)


def assert_pools_balanced(status: dict[str, Any]) -> None:
    """Every pool balances (`capacity == free + cached + in_use + quarantined`), nothing in use."""
    for name, pool in status["pools"].items():
        assert pool["in_use"] == 0, (name, pool)
        assert pool["capacity"] == pool["free"] + pool["cached"] + pool["in_use"] + pool["quarantined"], (name, pool)


def assert_clean_shutdown(proc: ServeProcess, code: int) -> None:
    """SIGTERM: uvicorn finishes its shutdown (the app stops the engine), then re-raises the signal."""
    assert code in (0, -signal.SIGTERM), f"ft serve exited with {code} on SIGTERM:\n{proc.log()}"
    log = proc.log()
    assert "Application shutdown complete" in log, log
    for pid in proc.engine_pids:
        assert not pid_alive(pid), f"engine process {pid} outlived the server"


@contextmanager
def serving(
    model: str, args: list[str], log_path: Path, api_key: str | None = None, deadline_s: float = READY_DEADLINE_S
) -> Iterator[ServeProcess]:
    """A healthy `ft serve` for the block; then SIGTERM, and a check that it shut down cleanly."""
    proc = ServeProcess(model, args, log_path, api_key=api_key)
    try:
        proc.wait_healthy(deadline_s)
        yield proc
        if proc.guarded:
            proc.assert_accounted()  # the server's end: nothing happened that no test answered for
    finally:
        code = proc.stop()
    assert_clean_shutdown(proc, code)
