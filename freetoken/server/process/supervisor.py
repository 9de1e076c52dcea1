"""The supervisor: starts the engine process, watches it, restarts it with backoff.

Owns the engine process's life: a `spawn` start (the API process never forks its state into the
engine), watching the process sentinel on the asyncio loop so that a death is seen the moment it
happens, the restart policy (exponential backoff, a bounded number of restarts within a window,
no restart at all when the engine reported that its model or configuration cannot work), the
restart count, the load deadline (an engine process that has not said Ready `load_timeout_s`
after its start is killed: before any engine served, the supervisor then gives up; a restart
that times out counts as a death under the restart policy), killing a hung engine on request
(`kill`, then it is handled like a death), and the stop sequence (wait, terminate, kill). It
does not talk to the engine: the client owns the sockets, tells it when the engine said Ready
(`ready`), and is told through two callbacks, `on_spawn` (a new incarnation is about to start:
give it its endpoints) and `on_exit` (it is gone, and what happens next). `EarlyEngine` is the
first incarnation started before any client or supervisor exists (`ft serve` starts it held
right after reading its flags). It never imports torch or the web stack: the engine process
imports its main module itself, and `ft serve` imports this module before anything heavy.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import multiprocessing.process
import multiprocessing.synchronize
import shutil
import signal
import tempfile
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from freetoken.config import EngineConfig
from freetoken.errors import EXIT_STARTUP, FreeTokenError
from freetoken.utils import logs
from freetoken.weights.source import DEFAULT_MODEL  # the model of a config that names none

log = logging.getLogger("freetoken.server")

# --load-timeout: from the engine process's start to its Ready (interpreter start, model load,
# pools, handshake). Gemma 3 270M takes ~4 s here (3.3 s of it the load) and ~12 s on a busier
# machine; a load reads and converts every weight byte (~13 s/GB at that rate), so a 20 GB
# checkpoint needs ~4-5 min: 600 s leaves room for that and a cold disk, and still ends a load
# that hangs (a stuck mount, a frozen device) within ten minutes. docs/operations.md.
DEFAULT_LOAD_TIMEOUT_S = 600.0
MIN_LOAD_TIMEOUT_S = 1.0


@dataclass(frozen=True)
class RestartPolicy:
    """Backoff `first_delay_s` doubling up to `max_delay_s`; give up when more than
    `max_restarts` exits fall within the last `window_s` seconds."""

    first_delay_s: float = 0.5
    max_delay_s: float = 10.0
    max_restarts: int = 5
    window_s: float = 300.0

    def next_delay(self, exit_times: Sequence[float], now: float) -> float | None:
        """Seconds to wait before the next start, given the times of past exits (this one
        included); None = give up."""
        recent = sum(1 for t in exit_times if now - t <= self.window_s)
        if recent > self.max_restarts:
            return None
        return min(self.first_delay_s * 2 ** max(recent - 1, 0), self.max_delay_s)


@dataclass(frozen=True)
class WorkerEndpoints:
    """Where one engine process listens (`engine`, it binds) and answers (`api`, it connects)."""

    engine: str
    api: str


@dataclass(frozen=True)
class ExitReport:
    """An engine process ended on its own. `restart_in` is None when the supervisor gave up."""

    pid: int | None
    exitcode: int | None
    how: str  # "exited with code 1", "was killed by SIGKILL"
    restart_in: float | None
    why_not: str | None = None  # why the supervisor gave up
    cause: str | None = None  # why the supervisor killed it (a hang, the load deadline)


def start_engine_process(
    config: EngineConfig, endpoints: WorkerEndpoints, served_name: str, incarnation: int, go: GoSignal | None = None
) -> multiprocessing.process.BaseProcess:
    """Start (`spawn`) one engine process on `endpoints`; returns once it is started (OSError
    when it cannot be). With `go`, the process imports its modules and then waits for `go` to be
    set before it reads any weight (`ft serve` starts it before its own checks are done)."""
    process = multiprocessing.get_context("spawn").Process(
        target=_engine_process_main,
        args=(
            config,
            endpoints,
            served_name,
            go,
            logs.current(),
        ),  # it logs as this process was told to (-v, --log-format)
        name=f"freetoken-engine-{incarnation}",
        daemon=True,  # if the API process exits without stop(), multiprocessing ends it
    )
    process.start()
    return process


def endpoints_in(directory: str, incarnation: int) -> WorkerEndpoints:
    """The endpoints of incarnation `incarnation` in the private directory `directory`."""
    return WorkerEndpoints(engine=f"ipc://{directory}/engine-{incarnation}", api=f"ipc://{directory}/api-{incarnation}")


@dataclass
class EarlyEngine:
    """An engine process started before its client exists: `ft serve` starts it held as soon as
    the model's path is known (server/startup.py) and releases it once the preflight and the bind
    passed, so that its imports and model load overlap the API process's own start-up (the web
    stack's imports, the tokenizer, uvicorn). The client adopts it as incarnation 0; until then
    its messages wait in ZMQ (the engine connects to an endpoint nobody has bound yet)."""

    directory: str
    process: multiprocessing.process.BaseProcess
    go: multiprocessing.synchronize.Event | None = None  # set: a held process may load

    @staticmethod
    def start(config: EngineConfig, served_name: str, held: bool = False) -> EarlyEngine:
        """Start the process; `held`, it imports its modules and waits for `release` before it
        reads any weight (started before the checks that may still refuse the configuration)."""
        directory = tempfile.mkdtemp(prefix="freetoken-")  # short: ipc paths are limited to ~100 bytes
        go = multiprocessing.get_context("spawn").Event() if held else None
        try:
            process = start_engine_process(config, endpoints_in(directory, 0), served_name, 0, go)
        except BaseException:
            shutil.rmtree(directory, ignore_errors=True)
            raise
        return EarlyEngine(directory, process, go)

    def release(self) -> None:
        """Let a held process load its model."""
        if self.go is not None:
            self.go.set()

    def abandon(self) -> None:
        """The server will not run after all (a later start-up step failed): end the process."""
        if self.process.exitcode is None:
            self.process.kill()
        self.process.join(5.0)
        shutil.rmtree(self.directory, ignore_errors=True)


def out_of_memory_hint(config: EngineConfig) -> str:
    """Why a load killed by SIGKILL is not retried, with the numbers a user needs: the model's
    size on disk and the memory available now (read only when that happens)."""
    import psutil

    from freetoken.weights.source import resolve_model

    try:
        path = resolve_model(config.model).path
        files = [path] if path.is_file() else list(path.glob("*.safetensors"))
        size = f"the model's files are {sum(f.stat().st_size for f in files) / 2**30:.1f} GiB, "
    except (FreeTokenError, OSError):
        size = ""
    available = psutil.virtual_memory().available / 2**30
    return (
        "it was killed while loading the model, most likely by the kernel's out-of-memory killer (`dmesg` says); "
        f"{size}{available:.1f} GiB of memory is available now; "
        "free memory, lower --num-tokens / --memory-ratio, or use a smaller quantization"
    )


def describe_exit(exitcode: int | None) -> str:
    if exitcode is None:
        return "ended (exit code unknown)"
    if exitcode < 0:
        try:
            return f"was killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return f"exited with code {exitcode}"


class GoSignal(Protocol):
    """What a held engine process waits on (a multiprocessing Event)."""

    def wait(self, timeout: float | None = None) -> bool: ...


GO_POLL_S = 0.25  # how often a held engine process checks that its parent is still there


def wait_for_go(go: GoSignal, parent_pid: int, getppid: Callable[[], int]) -> bool:
    """Block until `go` is set (True), or until the process that started this one is gone
    (False: reparented, `getppid` no longer `parent_pid`)."""
    while not go.wait(GO_POLL_S):
        if getppid() != parent_pid:
            return False
    return True


def _engine_process_main(
    config: EngineConfig,
    endpoints: WorkerEndpoints,
    served_name: str,
    go: GoSignal | None = None,
    log_settings: logs.LogSettings | None = None,
) -> None:
    """The engine process's entry point. The worker module (and with it torch) is imported here,
    in the engine process, so that the API process never pays for it; a held process (`go`)
    imports first, then waits to be released. It logs in the API process's format and level."""
    import os
    import sys

    logs.configure(log_settings or logs.LogSettings(), "engine")
    parent = os.getppid()
    from freetoken.server.process.worker import run_worker

    if go is not None and not wait_for_go(go, parent, os.getppid):
        sys.exit(0)  # the API process went away before releasing it
    sys.exit(run_worker(config, engine_endpoint=endpoints.engine, api_endpoint=endpoints.api, served_name=served_name))


async def _sentinel_ready(process: multiprocessing.process.BaseProcess, timeout: float | None) -> bool:
    """Wait until `process` is gone (its sentinel becomes readable); False on timeout."""
    loop = asyncio.get_running_loop()
    gone: asyncio.Future[None] = loop.create_future()
    sentinel = process.sentinel

    def on_ready() -> None:
        if not gone.done():
            gone.set_result(None)

    loop.add_reader(sentinel, on_ready)
    try:
        await asyncio.wait_for(gone, timeout)
        return True
    except asyncio.TimeoutError:
        return False
    finally:
        loop.remove_reader(sentinel)


class Supervisor:
    """Runs one engine process at a time on the current asyncio loop."""

    def __init__(
        self,
        config: EngineConfig,
        *,
        served_name: str,
        on_spawn: Callable[[int], WorkerEndpoints],
        on_exit: Callable[[ExitReport], Awaitable[None]],
        policy: RestartPolicy | None = None,
        load_timeout_s: float = DEFAULT_LOAD_TIMEOUT_S,
        first: multiprocessing.process.BaseProcess | None = None,
        start_process: Callable[
            [EngineConfig, WorkerEndpoints, str, int], multiprocessing.process.BaseProcess
        ] = start_engine_process,
    ) -> None:
        self._config = config
        self._start_process = start_process  # tests put processes that never load here
        # incarnation 0, when it was started before the supervisor (`ft serve` starts it before
        # importing the web stack, so the engine's imports and load overlap the API process's)
        self._first = first
        self.load_timeout_s = load_timeout_s
        self._served_name = served_name
        self._on_spawn = on_spawn
        self._on_exit = on_exit
        self.policy = policy or RestartPolicy()
        self.process: multiprocessing.process.BaseProcess | None = None
        self.restarts = 0
        self._exit_times: deque[float] = deque(maxlen=self.policy.max_restarts + 2)
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self._killed_because: str | None = None  # set by kill(): why the current process was killed
        self._ready = asyncio.Event()  # the current process said Ready: its load deadline is off
        self.served = False  # some engine process of this supervisor said Ready

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    @property
    def watching(self) -> bool:
        """True until the supervisor gave up or was stopped."""
        return self._task is not None and not self._task.done()

    def start(self) -> None:
        """Start the first engine process and keep watching; returns at once."""
        if self._task is not None:
            raise RuntimeError("the supervisor is already started")
        self._task = asyncio.get_running_loop().create_task(self._run(), name="freetoken-supervisor")

    async def _run(self) -> None:
        incarnation = 0
        while not self._stopping:
            self._ready.clear()
            endpoints = self._on_spawn(incarnation)
            try:
                if self._first is not None:
                    process, self._first = self._first, None
                else:
                    process = self._start_process(self._config, endpoints, self._served_name, incarnation)
            except OSError as err:
                report = self._plan(None, None, f"could not be started ({err})", None, False)
            else:
                self.process = process
                log.info("engine process %d started (incarnation %d)", process.pid, incarnation)
                load_timed_out = not await self._loaded_in_time(process)
                if load_timed_out:
                    self.kill(
                        f"the engine process {process.pid} did not load {self._config.model or DEFAULT_MODEL} "
                        f"within --load-timeout {self.load_timeout_s:g} s"
                    )
                await _sentinel_ready(process, None)
                process.join(1.0)  # the process is gone: this only reaps it
                if self._stopping:
                    return
                cause, self._killed_because = self._killed_because, None
                report = self._plan(
                    process.pid, process.exitcode, describe_exit(process.exitcode), cause, load_timed_out
                )
            log.error(
                "engine process %s %s%s; %s",
                report.pid,
                report.how,
                f" ({report.cause})" if report.cause else "",
                f"restarting in {report.restart_in:.1f} s"
                if report.restart_in is not None
                else f"giving up: {report.why_not}",
            )
            await self._on_exit(report)
            if report.restart_in is None:
                return
            await asyncio.sleep(report.restart_in)
            self.restarts += 1
            incarnation += 1

    async def _loaded_in_time(self, process: multiprocessing.process.BaseProcess) -> bool:
        """Wait until `process` said Ready (`ready()`) or is gone; False when `load_timeout_s`
        passed first."""
        gone = asyncio.ensure_future(_sentinel_ready(process, None))
        ready = asyncio.ensure_future(self._ready.wait())
        try:
            done, _ = await asyncio.wait(
                {gone, ready}, timeout=self.load_timeout_s, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            for waiter in (gone, ready):
                waiter.cancel()
            await asyncio.gather(gone, ready, return_exceptions=True)
        return bool(done)

    def ready(self) -> None:
        """The current engine process said Ready: its load deadline no longer applies."""
        self.served = True
        self._ready.set()

    def _plan(self, pid: int | None, code: int | None, how: str, cause: str | None, load_timed_out: bool) -> ExitReport:
        if code == EXIT_STARTUP:
            return ExitReport(pid, code, how, None, "the engine cannot start with this model and configuration", cause)
        if load_timed_out and not self.served:
            why_not = "no engine process has loaded the model in time yet (raise --load-timeout for a large model or a slow disk)"
            return ExitReport(pid, code, how, None, why_not, cause)
        if code == -signal.SIGKILL and cause is None and not self.served:
            # killed while loading, and not by the supervisor: the kernel's OOM killer, as a rule;
            # another load would only be killed again
            return ExitReport(pid, code, how, None, out_of_memory_hint(self._config), cause)
        now = time.monotonic()
        self._exit_times.append(now)
        delay = self.policy.next_delay(self._exit_times, now)
        why_not = None
        if delay is None:
            why_not = f"it died more than {self.policy.max_restarts} times within {self.policy.window_s:.0f} s"
        return ExitReport(pid, code, how, delay, why_not, cause)

    def kill(self, why: str) -> None:
        """SIGKILL the current engine process (it hung, or missed its load deadline): the watch
        loop then sees a death and plans what follows, with `why` as the exit report's cause."""
        process = self.process
        if process is None or process.exitcode is not None or self._stopping:
            return
        self._killed_because = why
        process.kill()  # SIGKILL ends a stopped (SIGSTOP) process too

    def kill_now(self) -> None:
        """Stop watching and SIGKILL the engine process (the server exits at once)."""
        self._stopping = True
        process = self.process
        if process is not None and process.exitcode is None:
            process.kill()

    async def stop(self, timeout: float = 10.0) -> None:
        """Stop watching and end the engine process: wait up to `timeout` for it to exit (the
        caller has sent it Shutdown), then terminate, then kill. Idempotent."""
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._first is not None:  # started early, never watched
            self.process, self._first = self._first, None
        process = self.process
        if process is None or process.exitcode is not None:
            return
        if not await _sentinel_ready(process, timeout):
            log.warning("engine process %d did not exit within %.1f s: terminating it", process.pid, timeout)
            process.terminate()
            if not await _sentinel_ready(process, 3.0):
                process.kill()
                await _sentinel_ready(process, 3.0)
        process.join(1.0)
