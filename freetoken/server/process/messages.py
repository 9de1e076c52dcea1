"""The typed messages between the API process and the engine process, and their wire format.

Owns the message dataclasses and their msgpack encoding: `encode(msg) -> bytes`,
`decode(bytes) -> msg`. Every message is a plain dataclass of ints, floats, strings, lists and
dicts; the type travels as its class name from a closed registry (no pickling, no string RPC
beyond that tag). A request's `CacheReport` travels flat, its fields beside the others of a
`TokenUpdate` (`report_fields` writes them, `TokenUpdate.report` reads them back whole). It knows
nothing of sockets or processes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import msgpack

from freetoken.request import CacheReport

# -- API process -> engine process ---------------------------------------------------------


@dataclass
class AddRequest:
    rid: str
    prompt_ids: list[int]
    params: dict[str, Any]  # SamplingParams fields (tuples as lists)
    eos_ids: list[int] = field(default_factory=list)
    boundaries: list[int] = field(default_factory=list)
    pins: list[list[float]] = field(default_factory=list)  # retention pins: [prompt position, TTL s]


@dataclass
class AbortRequest:
    """The client went away (or a timeout): end the request, release its pages."""

    rid: str


@dataclass
class FinishRequest:
    """The detokenizer matched a stop string: finish the request as `stop`."""

    rid: str


@dataclass
class StatusQuery:
    """Ask for the engine's `/v1/cache/status` document and counters."""

    query_id: int


@dataclass
class ResizeCache:
    """Resize the KV pools (tokens; a hybrid model's state pool: slots; None: leave that pool)
    and the expert cache (GiB); answered by a `StatusReply` whose status is `{"ok": true,
    "pools": ...}` or `{"ok": false, "error", "param", "conflict"}`."""

    query_id: int
    full_tokens: int | None = None
    swa_tokens: int | None = None
    expert_cache_gb: float | None = None
    state_slots: int | None = None


@dataclass
class Shutdown:
    pass


# -- engine process -> API process ---------------------------------------------------------


@dataclass
class Ready:
    """The engine loaded its model and serves. Sent once per engine process start."""

    model_name: str
    architecture: str
    vocab_size: int
    context_length: int
    cache_type: str
    page_size: int
    pid: int


@dataclass
class TokenUpdate:
    """New tokens of one request (and its end, when `finished`)."""

    rid: str
    token_ids: list[int]
    logprobs: list[Any] = field(default_factory=list)  # per token: None or [token_id, logprob, [[id, lp], ...]]
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    cached_tokens: int = 0  # the cache report's fields (freetoken/request.py, CacheReport)
    prompt_logprobs: list[Any] | None = None
    matched_tokens: int = 0
    miss_reason: str | None = None
    cache_creation_tokens: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0

    @property
    def report(self) -> CacheReport:
        return CacheReport(**{name: getattr(self, name) for name in _REPORT_FIELDS})


_REPORT_FIELDS = tuple(f.name for f in dataclasses.fields(CacheReport))


def report_fields(report: CacheReport) -> dict[str, Any]:
    """A `CacheReport` as the `TokenUpdate` fields it travels in."""
    return {name: getattr(report, name) for name in _REPORT_FIELDS}


@dataclass
class Refused:
    """The engine cannot serve this request (it never entered the queue)."""

    rid: str
    message: str
    code: str
    param: str | None = None


@dataclass
class StatusReply:
    query_id: int
    status: dict[str, Any]


@dataclass
class Heartbeat:
    """The engine process is alive (server/process/heartbeat.py): sent every interval by its own thread."""

    pid: int
    phase: str  # loading | serving
    steps: int  # engine steps completed
    step_running_s: float = 0.0  # how long the step now running has run (0 between steps)
    # while loading from the checkpoint: tensors read / in the checkpoint, bytes read / of tensor
    # data; from the weight cache: 0 / 0 tensors (it reads none by itself), the entry's bytes
    # checked / in all (weights/progress.py); all 0: no count yet
    load_tensors: int = 0
    load_tensors_total: int = 0
    load_bytes: int = 0
    load_bytes_total: int = 0


@dataclass
class EngineError:
    """A fatal error in the engine process, sent before it exits when it can."""

    message: str


MESSAGES: dict[str, type] = {
    cls.__name__: cls
    for cls in (
        AddRequest,
        AbortRequest,
        FinishRequest,
        StatusQuery,
        ResizeCache,
        Shutdown,
        Ready,
        TokenUpdate,
        Refused,
        StatusReply,
        Heartbeat,
        EngineError,
    )
}


def encode(msg: object) -> bytes:
    """msgpack of `[type name, fields]`."""
    name = type(msg).__name__
    if name not in MESSAGES:
        raise TypeError(f"{name} is not a FreeToken message")
    return msgpack.packb([name, dataclasses.asdict(msg)], use_bin_type=True)  # type: ignore[arg-type]


def decode(data: bytes) -> object:
    name, fields = msgpack.unpackb(data, raw=False)
    cls = MESSAGES.get(name)
    if cls is None:
        raise ValueError(f"unknown message type {name!r}")
    return cls(**fields)
