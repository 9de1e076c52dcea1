"""`ft serve`'s first steps, taken before the API process imports its web stack: check, listen,
start the engine.

Owns the order of a start: the settings' own checks and `--model` resolved; the engine process
started held (`EarlyEngine`: it imports torch and its modules, ~3 s on a 2-core Zen 3, then
waits; `ft serve` starts it before importing this module, whose imports take ~0.4 s); the model's
metadata-only preflight (preflight.py) and the listening socket (a port in use is a one-line
ConfigError naming `--port`) — a refusal ends the held process before it has read any weight —
then the engine released, so that its model load runs while this process imports FastAPI and
uvicorn, builds the tokenizer and the app (serve.py). What it
starts is handed over in `Started`; `Started.abandon` undoes it when a later step fails. It
imports no torch and no web framework.
"""

from __future__ import annotations

import errno
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass

from freetoken.config import EngineConfig
from freetoken.errors import ConfigError
from freetoken.server.preflight import model_facts, preflight
from freetoken.server.process.supervisor import EarlyEngine
from freetoken.server.settings import ServerConfig
from freetoken.weights.gguf_metadata import open_gguf
from freetoken.weights.source import ModelSource, resolve_model

BACKLOG = 2048  # uvicorn's default


@dataclass
class Started:
    """What `start` checked and started, for serve.py to take over."""

    source: ModelSource
    metadata: Mapping[str, object] | None  # the GGUF's key/value section (None: a model directory)
    served_name: str
    sock: socket.socket  # listening (early connections wait in its backlog); uvicorn serves on it
    engine: EarlyEngine | None
    began: float = 0.0  # time.monotonic() when `start` began (the ready block says how long a start took)

    def abandon(self) -> None:
        """A later start-up step failed: end the engine process and free the port."""
        if self.engine is not None:
            self.engine.abandon()
            self.engine = None
        self.sock.close()


def bind(host: str, port: int) -> socket.socket:
    """A TCP socket listening on host:port (uvicorn's own options: SO_REUSEADDR, IPv6 for a host
    with a colon). It listens at once: on Linux two sockets with SO_REUSEADDR may both be bound
    to one port until one listens. ConfigError naming `--port` / `--host` when the address cannot
    be had."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(BACKLOG)
    except socket.gaierror as err:  # an OSError too: first
        sock.close()
        raise ConfigError(f"--host: {host!r} is not an address of this machine ({err.strerror})") from None
    except OSError as err:
        sock.close()
        if err.errno == errno.EADDRINUSE:
            raise ConfigError(
                f"--port: {host}:{port} is already in use (another server?); "
                "pick another --port or stop what listens there"
            ) from None
        if err.errno == errno.EACCES:
            raise ConfigError(f"--port: {port} needs privileges to listen on; pick one above 1023") from None
        raise ConfigError(f"--host: cannot listen on {host}:{port} ({err.strerror or err})") from None
    return sock


def start(
    engine_config: EngineConfig,
    server_config: ServerConfig,
    *,
    start_engine: bool = True,
    engine: EarlyEngine | None = None,
    began: float | None = None,
) -> Started:
    """Check everything that can be checked without weights, take the port, and (with
    `start_engine`) start the engine process. Raises ConfigError / ModelLoadError before any
    weight is read: the engine process is started held as soon as the flags and the model's path
    are known (its ~3 s of imports overlap the checks), and released only once they passed.
    `engine`: already started held by the caller (`ft serve` starts it before importing this
    module; `began` is when that start began); it is ended if a check fails."""
    began = time.monotonic() if began is None else began
    try:
        engine_config.validate()
        server_config.validate()
        source = resolve_model(engine_config.model)
    except BaseException:
        if engine is not None:
            engine.abandon()
        raise
    served_name = server_config.served_model_name or source.name
    if engine is None and start_engine:
        engine = EarlyEngine.start(engine_config, served_name, held=True)
    try:
        # A GGUF file is checked whole (directory and metadata, no tensor data) before any weight is read.
        metadata = open_gguf(source.path).metadata if source.kind == "gguf" else None
        preflight(engine_config, model_facts(source, metadata))
        sock = bind(server_config.host, server_config.port)
    except BaseException:
        if engine is not None:
            engine.abandon()
        raise
    if engine is not None:
        engine.release()
    return Started(source, metadata, served_name, sock, engine, began)
