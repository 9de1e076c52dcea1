"""The engine process's main: build the engine, then serve messages and step until told to stop.

Owns the engine side of the wire: turning messages into engine calls (add, abort, finish, status)
and engine updates into `TokenUpdate` messages, the serving counters (and from them the periodic
throughput line, throughput.py), the periodic audit while busy, and what a failure means. An
exception inside a step ends the requests that were running with an error and serving goes on
if the KV audit then passes; otherwise, and for an integrity error that `debug_kv` makes fatal,
the process reports `EngineError` and exits non-zero (the supervisor restarts it). From its first line the process also runs the heartbeat thread
(heartbeat.py), which beats on its own socket whatever the step loop is doing; the loop only
publishes its step counter and when the running step began. `run_worker` is the one start-up
function (sockets, heartbeat, engine, Ready). It never tokenizes, and it never decides HTTP
status codes.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable

import zmq

from freetoken.config import EngineConfig
from freetoken.engine.build import build_engine
from freetoken.engine.engine import Engine, RequestRefused, RequestUpdate
from freetoken.engine.resize import ResizeRefused
from freetoken.errors import EXIT_FAILED, EXIT_OK, EXIT_STARTUP, FreeTokenError
from freetoken.kv.errors import KVIntegrityError
from freetoken.models.load import finish_cache_write
from freetoken.request import FinishReason, Request, SamplingParams, TokenLogprob
from freetoken.server.process.heartbeat import HeartbeatSender, Progress
from freetoken.server.process.messages import (
    AbortRequest,
    AddRequest,
    EngineError,
    FinishRequest,
    Ready,
    Refused,
    ResizeCache,
    Shutdown,
    StatusQuery,
    StatusReply,
    TokenUpdate,
    decode,
    encode,
    report_fields,
)
from freetoken.server.process.throughput import ThroughputLog, Totals
from freetoken.utils.heap import freeze_startup_heap

log = logging.getLogger("freetoken.engine")

AUDIT_INTERVAL_S = 5.0  # full audit while busy (at idle, every step audits)
IDLE_POLL_MS = 100  # how long an idle engine blocks for a message before checking its parent
MAX_MESSAGES_PER_STEP = 1024  # a flood of arrivals cannot starve the running requests
LINGER_MS = 2000  # how long the last messages (EngineError) may take to leave at exit
# How long a shutting-down engine waits for its weight-cache write (models/load.py): under the
# 10 s the supervisor gives an engine process to exit before it terminates it.
CACHE_WRITE_GRACE_S = 8.0
DISK_FLUSH_GRACE_S = 4.0  # of those, what the disk tier (--kv-disk-dir) may take to write its backlog


class EngineFatal(FreeTokenError):
    """The engine's state can no longer be trusted: the process must exit."""


def flat_logprob(lp: TokenLogprob | None) -> list[object] | None:
    """`[token_id, logprob, [[id, logprob], ...]]`, the wire form of one token's logprobs."""
    if lp is None:
        return None
    return [int(lp.token_id), float(lp.logprob), [[int(i), float(v)] for i, v in lp.top]]


def token_update(u: RequestUpdate) -> TokenUpdate:
    return TokenUpdate(
        rid=u.rid,
        token_ids=[int(t) for t in u.new_token_ids],
        logprobs=[flat_logprob(lp) for lp in u.new_logprobs],
        finished=u.finished,
        finish_reason=u.finish_reason.value if u.finish_reason is not None else None,
        error=u.error,
        prompt_logprobs=None if u.prompt_logprobs is None else [flat_logprob(lp) for lp in u.prompt_logprobs],
        **report_fields(u.report),
    )


def sampling_params(fields: dict[str, object]) -> SamplingParams:
    """SamplingParams from its wire form (tuples travel as lists); TypeError on unknown fields."""
    return SamplingParams(**{k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()})  # type: ignore[arg-type]


def _param_of(err: Exception) -> str | None:
    """The parameter a SamplingParams.validate message names first, if it names one."""
    word = str(err).split(" ", 1)[0]
    return word if word in SamplingParams.__dataclass_fields__ else None


class WorkerLoop:
    """Applies messages to an engine and steps it; `send` puts a message on the wire."""

    def __init__(
        self,
        engine: Engine,
        send: Callable[[object], None],
        progress: Progress | None = None,
        throughput: ThroughputLog | None = None,
    ) -> None:
        self.engine = engine
        self.send = send
        self.progress = progress or Progress()
        self.throughput = throughput or ThroughputLog()  # the periodic line while busy
        self.progress.phase = "serving"
        self.requests_added = 0
        self.requests_finished = 0
        self.requests_refused = 0
        self.tokens_generated = 0
        self.prompt_tokens = 0
        self.step_failures = 0
        self._ended_here: set[str] = set()  # ended by this loop; the engine's own update is a duplicate
        self._next_audit = time.monotonic() + AUDIT_INTERVAL_S

    # -- messages -------------------------------------------------------------------------

    def apply(self, msg: object) -> bool:
        """Apply one message; False when it asks the process to stop."""
        if isinstance(msg, AddRequest):
            self._add(msg)
        elif isinstance(msg, AbortRequest):
            self.engine.abort(msg.rid)
        elif isinstance(msg, FinishRequest):
            self.engine.finish(msg.rid, FinishReason.STOP)
        elif isinstance(msg, StatusQuery):
            self.send(StatusReply(msg.query_id, self.status()))
        elif isinstance(msg, ResizeCache):
            self.send(StatusReply(msg.query_id, self._resize(msg)))
        elif isinstance(msg, Shutdown):
            return False
        else:
            log.warning("ignoring an unexpected %s message", type(msg).__name__)
        return True

    def _add(self, msg: AddRequest) -> None:
        try:
            req = Request(
                msg.rid,
                list(msg.prompt_ids),
                sampling_params(msg.params),
                eos_ids=frozenset(msg.eos_ids),
                boundaries=tuple(msg.boundaries),
                pins=tuple((int(end), float(ttl)) for end, ttl in msg.pins),
            )
            self._check_queue()
            self.engine.add_request(req)
        except RequestRefused as err:
            self._refuse(Refused(msg.rid, str(err), err.code, err.param))
        except (ValueError, TypeError) as err:
            self._refuse(Refused(msg.rid, str(err), "invalid_request", _param_of(err)))
        else:
            self.requests_added += 1
            self.prompt_tokens += len(req.prompt_ids)

    def _resize(self, msg: ResizeCache) -> dict[str, object]:
        try:
            pools = self.engine.resize(msg.full_tokens, msg.swa_tokens, msg.expert_cache_gb, msg.state_slots)
        except ResizeRefused as err:
            return {"ok": False, "error": str(err), "param": err.param, "conflict": err.conflict}
        return {"ok": True, "pools": pools}

    def _refuse(self, refused: Refused) -> None:
        self.requests_refused += 1
        self.send(refused)

    def _check_queue(self) -> None:
        """Room for `max_running_requests` running plus `max_waiting_requests` waiting."""
        cfg = self.engine.config.engine
        sched = self.engine.scheduler
        if len(sched.waiting) + len(sched.running) >= cfg.max_running_requests + cfg.max_waiting_requests:
            raise RequestRefused(
                f"the engine's waiting queue is full ({cfg.max_waiting_requests} requests waiting)", code="queue_full"
            )

    def status(self) -> dict[str, object]:
        doc = self.engine.status()
        doc["engine"] = {
            "pid": os.getpid(),
            "steps": self.engine.steps,
            "waiting": len(self.engine.scheduler.waiting),
            "running": len(self.engine.scheduler.running),
            "preemptions": self.engine.scheduler.preemptions,
            "requests_added": self.requests_added,
            "requests_finished": self.requests_finished,
            "requests_refused": self.requests_refused,
            "prompt_tokens": self.prompt_tokens,
            "tokens_generated": self.tokens_generated,
            "step_failures": self.step_failures,
        }
        return doc

    # -- steps ----------------------------------------------------------------------------

    def tick(self) -> None:
        """One engine step (if there is work) and, while busy, the periodic audit. Raises
        EngineFatal (or KVIntegrityError under debug_kv) when serving cannot go on."""
        sched = self.engine.scheduler
        self.throughput.observe(
            busy=self.engine.has_work(),
            running=len(sched.running),
            waiting=len(sched.waiting),
            totals=Totals(
                self.tokens_generated, self.prompt_tokens, self.requests_finished, self.engine.prefilled_tokens
            ),
        )
        if not self.engine.has_work():
            self._next_audit = time.monotonic() + AUDIT_INTERVAL_S  # idle steps audit already
            return
        self.progress.step_started = time.monotonic()
        try:
            updates = self.engine.step()
        except KVIntegrityError:
            raise  # only under debug_kv: fatal by design
        except Exception as err:  # noqa: BLE001 - any failure of a step is reported, never silent
            self._recover(err)
            return
        finally:
            self.progress.step_started = None
            self.progress.steps = self.engine.steps
        self._publish(updates)
        if time.monotonic() >= self._next_audit:
            self._next_audit = time.monotonic() + AUDIT_INTERVAL_S
            self._publish(self.engine.audit_now())

    def _publish(self, updates: list[RequestUpdate]) -> None:
        for u in updates:
            if u.rid in self._ended_here:
                self._ended_here.discard(u.rid)
                continue
            self.tokens_generated += len(u.new_token_ids)
            if u.finished:
                self.requests_finished += 1
            self.send(token_update(u))

    def _recover(self, err: Exception) -> None:
        """A step raised: end the requests it was running, then go on only if the KV state
        still passes a full audit."""
        log.exception("an engine step failed")
        self.step_failures += 1
        message = f"the engine failed while running this request ({type(err).__name__}: {err})"
        for req in list(self.engine.scheduler.running):
            self.engine.finish(req.rid, FinishReason.ERROR, message)
            self._ended_here.add(req.rid)
            self.requests_finished += 1
            self.send(TokenUpdate(req.rid, [], finished=True, finish_reason=FinishReason.ERROR.value, error=message))
        report = self.engine.kv.audit(idle=not self.engine.scheduler.has_work())
        if not report.ok:
            violations = "; ".join(str(v) for v in report.violations)
            raise EngineFatal(f"{message}; afterwards the KV state failed its audit: {violations}")


def serve(loop: WorkerLoop, pull: zmq.Socket, parent_pid: int) -> int:  # type: ignore[type-arg]
    """Receive everything pending (blocking briefly only when idle), apply it, step; repeat."""
    while True:
        timeout = 0 if loop.engine.has_work() else IDLE_POLL_MS
        for _ in range(MAX_MESSAGES_PER_STEP):
            if not pull.poll(timeout):
                break
            timeout = 0
            try:
                msg = decode(pull.recv())
            except (ValueError, TypeError) as err:  # a bad message is the sender's bug, not ours
                log.error("dropped an undecodable message: %s", err)
                continue
            if not loop.apply(msg):
                log.info("engine process %d: shutting down", os.getpid())
                return EXIT_OK
        if os.getppid() != parent_pid:
            log.error("engine process %d: the API process is gone; exiting", os.getpid())
            return EXIT_OK
        loop.tick()


def run_worker(config: EngineConfig, *, engine_endpoint: str, api_endpoint: str, served_name: str) -> int:
    """The engine process: bind `engine_endpoint` (PULL), connect `api_endpoint` (PUSH), start
    the heartbeat, build the engine, send Ready, serve. Returns the process's exit code."""
    logging.basicConfig(
        level=logging.INFO
    )  # a no-op in an engine process, which configured its logging first (supervisor.py)
    # Ctrl-C and a SIGTERM to the process group reach the API process, which sends Shutdown
    # (and escalates to SIGKILL if that is not obeyed).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    parent_pid = os.getppid()
    log.debug("engine process %d starting with %s", os.getpid(), config)  # ft serve -v reaches this process
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.RCVHWM, 0)
    pull.bind(engine_endpoint)
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.SNDHWM, 0)
    push.setsockopt(zmq.LINGER, LINGER_MS)
    push.connect(api_endpoint)

    def send(msg: object) -> None:
        push.send(encode(msg))

    progress = Progress()
    heartbeat = HeartbeatSender(ctx, api_endpoint, progress, os.getpid())
    heartbeat.start()  # from now on, through the model load and every step
    try:
        try:
            # sets torch's threads (--threads or the physical cores); the load's count goes out in the heartbeats (the loading bar)
            engine, loaded = build_engine(config, progress.loaded)
        except FreeTokenError as err:
            log.error("the engine cannot start: %s", err)
            send(EngineError(str(err)))
            return EXIT_STARTUP
        send(
            Ready(
                model_name=served_name,
                architecture=loaded.config.architecture,
                vocab_size=loaded.config.vocab_size,
                context_length=engine.config.context_length,
                cache_type=engine.config.cache_type,
                page_size=config.page_size,
                pid=os.getpid(),
            )
        )
        freeze_startup_heap()  # the loaded model's objects: never rescanned by a full collection
        code = serve(WorkerLoop(engine, send, progress), pull, parent_pid)
        started = time.monotonic()
        if not engine.close(DISK_FLUSH_GRACE_S):  # the disk tier's write backlog, under the same deadline
            log.warning("engine process %d: the disk tier's write backlog was not all written", os.getpid())
        finish_cache_write(loaded, max(0.0, CACHE_WRITE_GRACE_S - (time.monotonic() - started)))
        return code
    except Exception as err:  # noqa: BLE001 - report it to the API process before dying
        log.exception("the engine process failed")
        send(EngineError(f"{type(err).__name__}: {err}"))
        return EXIT_FAILED
    finally:
        heartbeat.stop()
        pull.close(linger=0)
        push.close()
        ctx.term()
