"""The API process's handle on the engine process: `EngineClient`.

Owns the API side of the wire (ZMQ over `ipc://` in a private temp directory, a fresh pair of
endpoints per engine incarnation), the routing of engine messages to the request streams that
wait for them, the engine's state as the API sees it ("loading", "ready", "down" and why), and
the promise that no stream hangs: when the engine process dies, every in-flight stream gets a
terminal error update at once. It also judges the engine's heartbeat: no beat for
`hang_timeout_s` turns the state "down", ends every in-flight stream with an error and has the
supervisor kill the process (then restarted like a death); the supervisor keeps the load
deadline, and the client tells it when the engine said Ready. It runs on the API process's asyncio
loop, imports no torch, and knows nothing of HTTP (the app maps `EngineUnavailable` to 503 and
`EngineRefused` to 400).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import shutil
import tempfile
from collections.abc import AsyncIterator, Callable, Sequence

import zmq
import zmq.asyncio

from freetoken.config import EngineConfig
from freetoken.errors import FreeTokenError
from freetoken.request import SamplingParams
from freetoken.server.process.heartbeat import DEFAULT_HANG_TIMEOUT_S, HeartbeatWatch
from freetoken.server.process.heartbeat import INTERVAL_S as HEARTBEAT_INTERVAL_S
from freetoken.server.process.messages import (
    AbortRequest,
    AddRequest,
    EngineError,
    FinishRequest,
    Heartbeat,
    Ready,
    Refused,
    ResizeCache,
    Shutdown,
    StatusQuery,
    StatusReply,
    TokenUpdate,
    decode,
    encode,
)
from freetoken.server.process.supervisor import (
    DEFAULT_LOAD_TIMEOUT_S,
    EarlyEngine,
    ExitReport,
    RestartPolicy,
    Supervisor,
    WorkerEndpoints,
    endpoints_in,
)
from freetoken.utils.heap import freeze_startup_heap, return_freed_memory

log = logging.getLogger("freetoken.server")

STATUS_TIMEOUT_S = 30.0  # a status query waits for the current step to end


class EngineUnavailable(FreeTokenError):
    """The engine is loading, restarting or down (HTTP 503)."""


class EngineRefused(FreeTokenError):
    """The engine refused a request before queueing it (HTTP 400; `queue_full`: 429)."""

    def __init__(self, message: str, code: str = "invalid_request", param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.param = param


class EngineClient:
    """Starts, supervises and talks to one engine process."""

    def __init__(
        self,
        config: EngineConfig,
        *,
        served_name: str,
        policy: RestartPolicy | None = None,
        hang_timeout_s: float = DEFAULT_HANG_TIMEOUT_S,
        load_timeout_s: float = DEFAULT_LOAD_TIMEOUT_S,
        on_give_up: Callable[[str], None] | None = None,
        early: EarlyEngine | None = None,
        on_ready: Callable[[Ready], None] | None = None,
        on_load_progress: Callable[[int, int, int, int], None] | None = None,
    ) -> None:
        self.config = config
        self._early = early  # incarnation 0, already started (`EarlyEngine`)
        self.served_name = served_name
        self.hang_timeout_s = hang_timeout_s
        self.load_timeout_s = load_timeout_s
        self.heartbeat = HeartbeatWatch(hang_timeout_s)  # of the current incarnation
        self.hangs = 0  # engine processes killed for missing their heartbeat
        self._on_give_up = on_give_up
        self._on_ready = on_ready  # every Ready (the first: ft serve's ready block)
        self._on_load_progress = on_load_progress  # a loading beat's count (ft serve's loading bar)
        self._loading_reason = ""  # the state's reason while loading, before the load's count
        self._watchdog: asyncio.Task[None] | None = None
        self.state = "down"
        self.reason: str | None = "the engine has not been started"
        self.info: Ready | None = None
        self._policy = policy
        self._supervisor: Supervisor | None = None
        self._ctx: zmq.asyncio.Context | None = None
        self._dir: str | None = None
        self._push: zmq.Socket | None = None  # type: ignore[type-arg]  # sync: sends never block
        self._pull: zmq.asyncio.Socket | None = None
        self._receiver: asyncio.Task[None] | None = None
        self._streams: dict[str, asyncio.Queue[TokenUpdate | Refused]] = {}
        self._status_waiters: dict[int, asyncio.Future[dict[str, object]]] = {}
        self._query_ids = itertools.count()
        self._last_engine_error: str | None = None
        self._changed = asyncio.Event()  # set on every state change (wait_ready re-checks)
        self._stopped = False
        self._given_up = False  # the supervisor will not restart the engine

    # -- life -----------------------------------------------------------------------------

    @property
    def restarts(self) -> int:
        return self._supervisor.restarts if self._supervisor is not None else 0

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    @property
    def pid(self) -> int | None:
        """The engine process's pid (the current incarnation), if one was started."""
        return self._supervisor.pid if self._supervisor is not None else None

    async def start(self) -> None:
        """Launch the engine process; returns at once with state "loading"."""
        if self._supervisor is not None:
            raise RuntimeError("the engine client is already started")
        early, self._early = self._early, None
        # short: ipc paths are limited to ~100 bytes
        self._dir = early.directory if early is not None else tempfile.mkdtemp(prefix="freetoken-")
        self._ctx = zmq.asyncio.Context()
        self._supervisor = Supervisor(
            self.config,
            served_name=self.served_name,
            on_spawn=self._on_spawn,
            on_exit=self._on_exit,
            policy=self._policy,
            load_timeout_s=self.load_timeout_s,
            first=early.process if early is not None else None,
        )
        self._set_loading("the engine is loading the model")
        self._supervisor.start()
        self._watchdog = asyncio.get_running_loop().create_task(
            self._watch_heartbeat(), name="freetoken-heartbeat-watch"
        )

    async def wait_ready(self, timeout: float) -> bool:
        """Wait until the engine serves; False after `timeout` or once the supervisor gave up."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.state != "ready":
            if self._gave_up():
                return False
            left = deadline - loop.time()
            if left <= 0:
                return False
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), left)
            except asyncio.TimeoutError:
                return self.state == "ready"
        return True

    def _gave_up(self) -> bool:
        return self._stopped or self._given_up or self._supervisor is None

    async def stop(self, timeout: float = 10.0) -> None:
        """Shut the engine process down (Shutdown, then terminate/kill after `timeout`) and end
        every in-flight stream with an error. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        if self._early is not None:  # never started: end the early process
            self._early.abandon()
            self._early = None
        self._set_state("down", "the engine was stopped")
        if self._watchdog is not None:
            self._watchdog.cancel()
            await asyncio.gather(self._watchdog, return_exceptions=True)
        self._send_now(Shutdown())
        if self._supervisor is not None:
            await self._supervisor.stop(timeout)
        await self._close_channel()
        self._fail_in_flight("the engine was stopped")
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def kill_engine(self) -> None:
        """SIGKILL the engine process, no restart (a second SIGTERM: exit at once)."""
        self._set_state("down", "the server is exiting")
        if self._supervisor is not None:
            self._supervisor.kill_now()

    def _set_loading(self, reason: str) -> None:
        self._loading_reason = reason
        self._set_state("loading", reason)

    def _loading_beat(self, beat: Heartbeat) -> None:
        """A beat of a loading engine: its count goes into the 503's reason and to the bar."""
        if self.state != "loading" or (beat.load_tensors_total <= 0 and beat.load_bytes_total <= 0):
            return
        size = f"{beat.load_bytes / 1e9:.2f}/{beat.load_bytes_total / 1e9:.2f} GB"
        if beat.load_tensors_total <= 0:  # a start from the weight cache: its entry's bytes checked
            self.reason = f"{self._loading_reason} ({size} of the weight cache read)"
        else:
            count = f"{beat.load_tensors}/{beat.load_tensors_total} tensors"
            if beat.load_bytes_total:
                count += f", {size}"
            self.reason = f"{self._loading_reason} ({count} read)"
        if self._on_load_progress is not None:
            self._on_load_progress(beat.load_tensors, beat.load_tensors_total, beat.load_bytes, beat.load_bytes_total)

    def _set_state(self, state: str, reason: str | None) -> None:
        self.state = state
        self.reason = reason
        self._changed.set()

    # -- requests -------------------------------------------------------------------------

    def generate(
        self,
        rid: str,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        eos_ids: Sequence[int],
        boundaries: Sequence[int] = (),
        pins: Sequence[tuple[int, float]] = (),
    ) -> AsyncIterator[TokenUpdate]:
        """Stream `rid`'s updates until one has `finished`. Raises EngineUnavailable now if the
        engine is not ready; EngineRefused (on the first iteration) if the engine refuses it.
        Closing the stream early aborts the request."""
        self._require_ready()
        params_dict = {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(params).items()}
        add = AddRequest(rid, list(prompt_ids), params_dict, list(eos_ids), list(boundaries), [[e, t] for e, t in pins])
        return self._stream(add)

    async def _stream(self, add: AddRequest) -> AsyncIterator[TokenUpdate]:
        self._require_ready()
        rid = add.rid
        if rid in self._streams:
            raise EngineRefused(f"request id {rid!r} is already in flight")
        queue: asyncio.Queue[TokenUpdate | Refused] = asyncio.Queue()
        self._streams[rid] = queue
        done = False
        try:
            self._send_now(add, required=True)
            while True:
                msg = await queue.get()
                if isinstance(msg, Refused):
                    done = True
                    raise EngineRefused(msg.message, msg.code, msg.param)
                done = msg.finished
                yield msg
                if done:
                    return
        finally:
            if self._streams.get(rid) is queue:
                del self._streams[rid]
            if not done:  # the consumer went away (aclose, cancellation): free the engine's pages
                self._send_now(AbortRequest(rid))

    def abort_all(self, why: str) -> int:
        """End every in-flight stream now with error `why` and abort its request in the engine
        (a drain that ran out of time). Returns how many there were."""
        rids = list(self._streams)
        for rid in rids:
            self._send_now(AbortRequest(rid))
        self._fail_in_flight(why)
        return len(rids)

    async def abort(self, rid: str) -> None:
        """End `rid` now (its stream gets a finished update with reason "abort")."""
        self._send_now(AbortRequest(rid))

    async def finish(self, rid: str) -> None:
        """A stop string matched: finish `rid` as "stop"."""
        self._send_now(FinishRequest(rid))

    async def status(self) -> dict[str, object]:
        """The engine's status document (`/v1/cache/status` fields plus `engine` counters)."""
        return await self._query(StatusQuery)

    async def resize_cache(
        self,
        full_tokens: int | None,
        swa_tokens: int | None,
        expert_cache_gb: float | None = None,
        state_slots: int | None = None,
    ) -> dict[str, object]:
        """Resize the engine's KV pools (a hybrid model's state pool too) and expert cache:
        `{"ok": true, "pools"}` or `{"ok": false, "error", "param", "conflict"}`."""
        return await self._query(lambda qid: ResizeCache(qid, full_tokens, swa_tokens, expert_cache_gb, state_slots))

    async def _query(self, make: Callable[[int], object]) -> dict[str, object]:
        """Send the query `make(query_id)` and wait for its StatusReply."""
        self._require_ready()
        qid = next(self._query_ids)
        future: asyncio.Future[dict[str, object]] = asyncio.get_running_loop().create_future()
        self._status_waiters[qid] = future
        try:
            self._send_now(make(qid), required=True)
            return await asyncio.wait_for(future, STATUS_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise EngineUnavailable(
                f"the engine did not answer a status query within {STATUS_TIMEOUT_S:.0f} s"
            ) from None
        finally:
            self._status_waiters.pop(qid, None)

    def _require_ready(self) -> None:
        if self.state != "ready":
            raise EngineUnavailable(self.reason or f"the engine is {self.state}")

    def _send_now(self, msg: object, required: bool = False) -> None:
        """Queue `msg` for the engine without waiting (unbounded queue, connected pipe)."""
        if self._push is None:
            if required:
                raise EngineUnavailable(self.reason or "the engine is not running")
            return
        try:
            self._push.send(encode(msg), flags=zmq.NOBLOCK)
        except zmq.ZMQError as err:
            if required:
                raise EngineUnavailable(f"cannot reach the engine: {err}") from None
            log.warning("dropped a %s message for the engine: %s", type(msg).__name__, err)

    # -- the wire -------------------------------------------------------------------------

    def _on_spawn(self, incarnation: int) -> WorkerEndpoints:
        """A new engine process is about to start: fresh endpoints, a fresh receiver."""
        if self._ctx is None or self._dir is None:
            raise RuntimeError("the engine client is not started")
        endpoints = endpoints_in(self._dir, incarnation)
        push = self._ctx.socket(zmq.PUSH, socket_class=zmq.Socket)
        push.setsockopt(zmq.SNDHWM, 0)
        push.setsockopt(zmq.LINGER, 0)
        push.connect(endpoints.engine)  # connecting creates the pipe now: sends queue until the engine binds
        pull = self._ctx.socket(zmq.PULL)
        pull.setsockopt(zmq.RCVHWM, 0)
        pull.setsockopt(zmq.LINGER, 0)
        pull.bind(endpoints.api)
        self._push, self._pull = push, pull
        self._last_engine_error = None
        self.heartbeat = HeartbeatWatch(self.hang_timeout_s)
        self._receiver = asyncio.get_running_loop().create_task(self._receive(pull), name="freetoken-engine-receiver")
        if incarnation > 0:
            self._set_loading(f"the engine is restarting (restart {incarnation}): loading the model")
        return endpoints

    async def _on_exit(self, report: ExitReport) -> None:
        """The engine process is gone: deliver what it sent before dying, then end every
        in-flight stream with an error and say why we are down."""
        await self._close_channel(drain=True)
        how = f"{report.cause}; it {report.how}" if report.cause else f"the engine process {report.how}"
        if self._last_engine_error:
            how += f" ({self._last_engine_error})"
        if report.restart_in is not None:
            reason = f"{how}; restarting in {report.restart_in:.1f} s"
        else:
            reason = f"{how}; not restarting: {report.why_not}"
            self._given_up = True
        self._set_state("down", reason)
        self._fail_in_flight(how)
        if self._given_up and self._on_give_up is not None:
            self._on_give_up(reason)

    async def _watch_heartbeat(self) -> None:
        """Every half interval: has the current engine missed its deadline? Before judging, give
        the receiver one more interval (beats may be waiting in the socket after a busy spell of
        this loop or a starved API process: silence it caused itself is not the engine's)."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(HEARTBEAT_INTERVAL_S / 2)
            if self._supervisor is None or self.state == "down" or not self.heartbeat.overdue(loop.time()):
                continue
            await asyncio.sleep(HEARTBEAT_INTERVAL_S)
            silence = self.heartbeat.silence_s(loop.time())
            if silence is None or silence <= self.hang_timeout_s or self.state == "down":
                continue
            self._hung(silence)

    def _hung(self, silence: float) -> None:
        pid = self.pid
        last = self.heartbeat.last
        where = "" if last is None else f" (last beat: {last.phase}, {last.steps} steps done)"
        why = (
            f"the engine process {pid} stopped answering: no heartbeat for {silence:.1f} s "
            f"(--engine-hang-timeout {self.hang_timeout_s:g} s){where}"
        )
        log.error("%s; killing it", why)
        self.hangs += 1
        self._set_state("down", f"{why}; killing it")
        self._fail_in_flight(why)
        if self._supervisor is not None:
            self._supervisor.kill(why)

    async def _close_channel(self, drain: bool = False) -> None:
        if self._receiver is not None:
            self._receiver.cancel()
            await asyncio.gather(self._receiver, return_exceptions=True)
            self._receiver = None
        if self._pull is not None:
            while drain:
                try:
                    data = await self._pull.recv(flags=zmq.NOBLOCK)
                except zmq.Again:
                    break
                self._dispatch(data)
            self._pull.close(linger=0)
            self._pull = None
        if self._push is not None:
            self._push.close(linger=0)
            self._push = None

    def _fail_in_flight(self, why: str) -> None:
        error = f"{why} before the request finished"
        for rid, queue in self._streams.items():
            queue.put_nowait(TokenUpdate(rid, [], finished=True, finish_reason="error", error=error))
        for future in self._status_waiters.values():
            if not future.done():
                future.set_exception(EngineUnavailable(why))

    async def _receive(self, pull: zmq.asyncio.Socket) -> None:
        """Dispatch every message as it arrives, until cancelled. The socket's FD is watched
        directly and drained with non-blocking receives: zmq.asyncio's awaitable recv costs a
        future and two epoll registrations per message, and a token stream is a message a token."""
        sync = zmq.Socket.shadow(pull.underlying)
        loop = asyncio.get_running_loop()
        fd = sync.getsockopt(zmq.FD)

        def drain() -> None:  # the FD is edge-triggered: read until EVENTS shows nothing left
            while sync.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                try:
                    data = sync.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self._dispatch(data)

        loop.add_reader(fd, drain)
        try:
            drain()  # messages queued before the reader was added raise no edge
            await loop.create_future()  # until cancelled
        finally:
            loop.remove_reader(fd)

    def _dispatch(self, data: bytes) -> None:
        try:
            msg = decode(data)
        except (ValueError, TypeError) as err:
            log.error("dropped an undecodable message from the engine: %s", err)
            return
        if isinstance(msg, (TokenUpdate, Refused)):
            queue = self._streams.get(msg.rid)
            if queue is not None:  # else: the stream was closed early; the abort is on its way
                queue.put_nowait(msg)
        elif isinstance(msg, Heartbeat):
            self.heartbeat.saw(msg, asyncio.get_running_loop().time())
            if msg.phase == "loading":
                self._loading_beat(msg)
        elif isinstance(msg, StatusReply):
            future = self._status_waiters.get(msg.query_id)
            if future is not None and not future.done():
                future.set_result(msg.status)
        elif isinstance(msg, Ready):
            self.heartbeat.ready(asyncio.get_running_loop().time())
            if self._supervisor is not None:
                self._supervisor.ready()
            self.info = msg
            log.log(
                logging.DEBUG if self._on_ready is not None else logging.INFO,
                "engine process %d ready: %s (%s), context %d",
                msg.pid,
                msg.model_name,
                msg.architecture,
                msg.context_length,
            )
            self._set_state("ready", None)
            if self._on_ready is not None:
                self._on_ready(msg)
            freeze_startup_heap()  # the API process's startup objects too (tokenizer, templates)
            return_freed_memory()  # and what building them freed (the tokenizer's merges: ~100 MB for Gemma 3)
        elif isinstance(msg, EngineError):
            log.error("engine error: %s", msg.message)
            self._last_engine_error = msg.message
        else:
            log.warning("ignoring an unexpected %s message from the engine", type(msg).__name__)
