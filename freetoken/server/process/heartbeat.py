"""The engine heartbeat: a beat every `INTERVAL_S` from a thread of the engine process, and the
API process's judgement of when the beats stopped.

Owns `Progress` (what the engine loop publishes for the beat: its step counter and since when the
current step runs), `HeartbeatSender` (a daemon thread of the engine process with its own PUSH
socket to the API endpoint, beating from process start -- through the model load and through
every step, however long) and `HeartbeatWatch` (the API side: when the last beat came and
whether the `--engine-hang-timeout` deadline passed).

How a slow step is told apart from a hang: the beats do not come from the step loop. The sender
is its own thread, and torch releases the GIL inside its kernels (and the interpreter hands the
GIL over every few milliseconds in Python code), so a step of any length -- a long prefill chunk
on a slow machine -- keeps the beats coming; the beat carries the step counter and how long the
current step has run, for the logs. Only a process that stops being scheduled at all misses
beats: SIGSTOP, a deadlock or a C call that holds the GIL, a process frozen in the kernel. A main
thread blocked while *not* holding the GIL (waiting on a lock forever) keeps beating; its beats
show the same step running ever longer, which the API process logs. It imports no torch.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import zmq

from freetoken.server.process.messages import Heartbeat, encode

log = logging.getLogger("freetoken.server")

INTERVAL_S = 0.5  # between beats; --engine-hang-timeout must be a good many of these
MIN_HANG_TIMEOUT_S = 4 * INTERVAL_S
# --engine-hang-timeout: beats do not wait for steps, so this bounds scheduling stalls, not step
# time (docs/operations.md has the gaps measured in the hour-long soak).
DEFAULT_HANG_TIMEOUT_S = 30.0


@dataclass
class Progress:
    """Written by the engine loop, read by the sender thread (plain attribute reads and writes)."""

    phase: str = "loading"  # loading | serving
    steps: int = 0
    step_started: float | None = None  # time.monotonic() when the running step began; None between steps
    # the load's count (tensors read, in the checkpoint, bytes read, of tensor data): one tuple,
    # replaced whole, so that the sender thread never reads half of an update
    load: tuple[int, int, int, int] = (0, 0, 0, 0)

    def loaded(self, tensors: int, tensors_total: int, done_bytes: int, total_bytes: int) -> None:
        """The weight loader's progress callback (weights/gguf.py, weights/safetensors.py, and
        weights/weight_cache.py for a start from the weight cache)."""
        self.load = (tensors, tensors_total, done_bytes, total_bytes)

    def beat(self, pid: int) -> Heartbeat:
        started = self.step_started
        running = 0.0 if started is None else time.monotonic() - started
        tensors, tensors_total, done_bytes, total_bytes = self.load if self.phase == "loading" else (0, 0, 0, 0)
        return Heartbeat(
            pid=pid,
            phase=self.phase,
            steps=self.steps,
            step_running_s=round(running, 3),
            load_tensors=tensors,
            load_tensors_total=tensors_total,
            load_bytes=done_bytes,
            load_bytes_total=total_bytes,
        )


class HeartbeatSender:
    """A daemon thread sending `progress.beat()` to `endpoint` every INTERVAL_S until `stop()`."""

    def __init__(self, ctx: zmq.Context, endpoint: str, progress: Progress, pid: int) -> None:  # type: ignore[type-arg]
        self._ctx = ctx
        self._endpoint = endpoint
        self._progress = progress
        self._pid = pid
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="freetoken-heartbeat", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """End the thread and close its socket (before the context is terminated)."""
        self._stop.set()
        self._thread.join(2 * INTERVAL_S + 1.0)

    def _run(self) -> None:
        sock = self._ctx.socket(zmq.PUSH)  # created in this thread: a ZMQ socket belongs to one thread
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 4)  # a reader that is not reading needs no backlog of beats
        sock.connect(self._endpoint)
        try:
            while not self._stop.is_set():
                try:
                    sock.send(encode(self._progress.beat(self._pid)), flags=zmq.NOBLOCK)
                except zmq.Again:
                    pass  # the API side is not reading: it judges us by the beats it gets
                self._stop.wait(INTERVAL_S)
        finally:
            sock.close(linger=0)


class HeartbeatWatch:
    """The API side of one engine incarnation. The deadline counts from the engine's Ready (an
    engine that freezes before its first serving beat is judged too), then from each serving
    beat; never before: the interpreter's start (importing torch) sends none, and the model load
    holds the GIL in long C calls (gaps of ~8 s were measured loading Gemma 3 270M on a busy
    2-core machine; a large model's would be longer). A process that dies meanwhile is seen by
    the supervisor; loading beats are kept only for the logs."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.last: Heartbeat | None = None
        self.last_at: float | None = None
        self.max_gap_s = 0.0  # the longest wait between two beats seen so far
        self._long_step_logged = 0.0

    def saw(self, beat: Heartbeat, now: float) -> None:
        if beat.phase != "serving":
            self.last = beat
            return
        if self.last_at is not None:
            self.max_gap_s = max(self.max_gap_s, now - self.last_at)
        self.last, self.last_at = beat, now
        if beat.step_running_s >= self.timeout_s and beat.step_running_s - self._long_step_logged >= self.timeout_s:
            self._long_step_logged = beat.step_running_s
            log.warning(
                "engine process %d: step %d has run for %.0f s (the engine is alive: its heartbeat goes on)",
                beat.pid,
                beat.steps + 1,
                beat.step_running_s,
            )
        elif beat.step_running_s < self._long_step_logged:
            self._long_step_logged = 0.0

    def ready(self, now: float) -> None:
        """The engine said Ready: from now on its beats are due."""
        if self.last_at is None:
            self.last_at = now

    def silence_s(self, now: float) -> float | None:
        """Seconds since the last beat; None before the first one."""
        return None if self.last_at is None else now - self.last_at

    def overdue(self, now: float) -> bool:
        silence = self.silence_s(now)
        return silence is not None and silence > self.timeout_s
