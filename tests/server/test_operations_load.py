"""The load deadline (`--load-timeout`): an engine process that has not said Ready in time is
killed. Before any engine served, `ft serve` then exits 1 with one line naming the model and the
deadline, no process left behind; a restart that times out (after a hang or a death) is killed
by the same deadline and restarted under the restart policy. The hung load is injected by
freezing the engine process (SIGSTOP), as the hang tests do; deadlines are hang guards, nothing
is timed."""

from __future__ import annotations

import asyncio
import os
import signal
import multiprocessing
import multiprocessing.process
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
from serving import free_port, pid_alive

from freetoken.config import EngineConfig
from freetoken.server.process.supervisor import (
    ExitReport,
    RestartPolicy,
    Supervisor,
    WorkerEndpoints,
)

ROOT = Path(__file__).resolve().parents[2]
GUARD_S = 120.0


class EngineFreezer(threading.Thread):
    """Suspends every engine process `parent` spawns (multiprocessing's `spawn_main` children,
    not its resource tracker) the moment it shows up, and records every descendant it saw."""

    def __init__(self, parent: int) -> None:
        super().__init__(daemon=True)
        self.parent = psutil.Process(parent)
        self.frozen: list[int] = []
        self.seen: set[int] = set()
        self.quit = threading.Event()

    def run(self) -> None:
        while not self.quit.is_set():
            try:
                children = self.parent.children(recursive=True)
            except psutil.NoSuchProcess:
                return
            for child in children:
                self.seen.add(child.pid)
                try:
                    if child.pid not in self.frozen and "spawn_main" in " ".join(child.cmdline()):
                        child.suspend()
                        self.frozen.append(child.pid)
                except psutil.NoSuchProcess:
                    continue
            time.sleep(0.001)


def test_a_hung_first_load_exits_1_naming_model_and_deadline(tiny_gemma_dir: Path) -> None:
    cmd = [sys.executable, "-m", "freetoken.cli", "serve", "--model", str(tiny_gemma_dir), "--port", str(free_port()),
           "--threads", "1", "--dtype", "float32", "--load-timeout", "3"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    freezer = EngineFreezer(proc.pid)
    freezer.start()
    try:
        _, stderr = proc.communicate(timeout=GUARD_S)  # a hung load used to keep it running forever
    finally:
        freezer.quit.set()
        if proc.poll() is None:
            proc.kill()
    assert freezer.frozen, f"no engine process was caught loading:\n{stderr}"
    assert proc.returncode == 1, stderr
    errors = [line for line in stderr.splitlines() if line.startswith("ft serve: error:")]
    assert len(errors) == 1, stderr
    assert f"did not load {tiny_gemma_dir} within --load-timeout 3 s" in errors[0] and "not restarting" in errors[0], errors
    end = time.monotonic() + GUARD_S  # the resource tracker ends when it reads its pipe's EOF
    while any(pid_alive(pid) for pid in freezer.seen) and time.monotonic() < end:
        time.sleep(0.05)
    assert not [pid for pid in freezer.seen if pid_alive(pid)], "a child process outlived ft serve"


class HungLoads:
    """Stands in for the supervisor's process start: each "engine process" is a real process
    that sleeps, so it never says Ready unless the test calls `Supervisor.ready()`."""

    def __init__(self) -> None:
        self.started: list[multiprocessing.process.BaseProcess] = []

    def start(self, config: EngineConfig, endpoints: WorkerEndpoints, served_name: str,
              incarnation: int) -> multiprocessing.process.BaseProcess:
        process = multiprocessing.get_context("fork").Process(target=time.sleep, args=(GUARD_S,),
                                                              name=f"hung-{incarnation}", daemon=True)
        process.start()
        self.started.append(process)
        return process


def supervised(
    ready_incarnations: set[int], policy: RestartPolicy, model: str | None = "hung-model"
) -> tuple[Supervisor, HungLoads, list[ExitReport]]:
    """A supervisor over HungLoads whose incarnations in `ready_incarnations` say Ready at once."""
    reports: list[ExitReport] = []
    holder: list[Supervisor] = []

    def on_spawn(incarnation: int) -> WorkerEndpoints:
        if incarnation in ready_incarnations:
            asyncio.get_running_loop().call_soon(holder[0].ready)  # runs once the process started
        return WorkerEndpoints(engine="ipc://unused-engine", api="ipc://unused-api")

    async def on_exit(report: ExitReport) -> None:
        reports.append(report)

    loads = HungLoads()  # the fault injection: loads that never finish
    sup = Supervisor(EngineConfig(model=model), served_name="x", on_spawn=on_spawn, on_exit=on_exit,
                     policy=policy, load_timeout_s=1.0, start_process=loads.start)
    holder.append(sup)
    return sup, loads, reports


async def wait_for(check: Callable[[], bool]) -> None:
    end = time.monotonic() + GUARD_S
    while not check():
        assert time.monotonic() < end, "hang guard"
        await asyncio.sleep(0.02)


@pytest.mark.parametrize(("model", "named"), [("hung-model", "hung-model"), (None, "gemma3-270m")])
def test_supervisor_gives_up_when_no_engine_ever_loaded_in_time(model: str | None, named: str) -> None:
    """The message names the model; `ft serve` with no model loads the default, and says so
    (it used to say "did not load None")."""

    async def scenario() -> None:
        sup, loads, reports = supervised(set(), RestartPolicy(first_delay_s=0.01), model)
        sup.start()
        await wait_for(lambda: not sup.watching)
        assert len(reports) == 1 and len(loads.started) == 1, reports
        report = reports[0]
        assert report.restart_in is None and report.how == "was killed by SIGKILL", report
        assert report.cause is not None and re.search(rf"did not load {named} within --load-timeout 1 s", report.cause), report
        assert report.why_not is not None and "--load-timeout" in report.why_not, report
        assert not loads.started[0].is_alive()

    asyncio.run(scenario())


def test_a_restart_after_a_hang_has_the_same_load_deadline() -> None:
    """Incarnation 0 serves and is killed as hung; the restart never loads and is killed by the
    load deadline, which (an engine served before) counts as a death: a third one serves."""

    async def scenario() -> None:
        sup, loads, reports = supervised({0, 2}, RestartPolicy(first_delay_s=0.01))
        sup.start()
        await wait_for(lambda: sup.served and len(loads.started) == 1)
        sup.kill("the engine process stopped answering (test)")
        await wait_for(lambda: len(loads.started) == 3 and sup._ready.is_set())
        await sup.stop(timeout=1.0)
        assert len(reports) == 2 and all(r.restart_in is not None for r in reports), reports
        assert reports[0].cause == "the engine process stopped answering (test)", reports
        assert reports[1].cause is not None and "did not load hung-model within --load-timeout 1 s" in reports[1].cause
        assert sup.restarts == 2 and not any(p.is_alive() for p in loads.started)

    asyncio.run(scenario())


def test_restarts_that_keep_timing_out_end_in_giving_up() -> None:
    """The restart policy bounds them: with max_restarts 2 (the hang was one exit), the second
    timed-out restart ends it."""

    async def scenario() -> None:
        sup, loads, reports = supervised({0}, RestartPolicy(first_delay_s=0.01, max_restarts=2))
        sup.start()
        await wait_for(lambda: sup.served and len(loads.started) == 1)
        sup.kill("the engine process stopped answering (test)")
        await wait_for(lambda: not sup.watching)
        assert len(reports) == 3 and len(loads.started) == 3, reports
        assert reports[1].restart_in is not None and reports[2].restart_in is None, reports
        assert all("--load-timeout 1 s" in (r.cause or "") for r in reports[1:]), reports
        assert reports[2].why_not is not None and "died more than 2 times" in reports[2].why_not, reports[2]
        assert not any(p.is_alive() for p in loads.started)

    asyncio.run(scenario())


def _killed_by_the_kernel() -> None:
    os.kill(os.getpid(), signal.SIGKILL)  # as the OOM killer ends a load


def test_a_load_killed_by_sigkill_is_not_retried_and_is_explained() -> None:
    """A load the kernel kills (out of memory) would be killed again: the supervisor gives up at
    once, saying what most likely happened and the numbers to act on."""

    async def scenario() -> None:
        started: list[multiprocessing.process.BaseProcess] = []

        def start(config: EngineConfig, endpoints: WorkerEndpoints, served_name: str, incarnation: int):  # type: ignore[no-untyped-def]
            process = multiprocessing.get_context("fork").Process(target=_killed_by_the_kernel, daemon=True)
            process.start()
            started.append(process)
            return process

        reports: list[ExitReport] = []

        async def on_exit(report: ExitReport) -> None:
            reports.append(report)

        sup = Supervisor(EngineConfig(model="gemma3-270m"), served_name="x",
                         on_spawn=lambda i: WorkerEndpoints(engine="ipc://unused-engine", api="ipc://unused-api"),
                         on_exit=on_exit, policy=RestartPolicy(first_delay_s=0.01), start_process=start)
        sup.start()
        await wait_for(lambda: not sup.watching)
        assert len(started) == 1 and len(reports) == 1, reports  # not restarted
        report = reports[0]
        assert report.how == "was killed by SIGKILL" and report.restart_in is None and report.cause is None, report
        assert report.why_not is not None and "out-of-memory killer" in report.why_not, report
        assert "the model's files are" in report.why_not and "GiB of memory is available" in report.why_not, report

    asyncio.run(scenario())
