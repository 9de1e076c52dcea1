"""`ft serve`: after startup.py's checks (preflight, the port, the engine process started), load
the tokenizer, start the engine client, build the app, run uvicorn, and exit with a status that
says what happened.

Owns the API process's start-up after startup.py (the tokenizer and the `--chat-template`
override, the client adopting the early engine process, the app), what the terminal shows while
it starts (console.py's loading bar, fed by the client from the engine's heartbeats, and the
ready block when the engine first says Ready; uvicorn logs through the root handler, without its
"running on" line) and uvicorn's lifetime on the socket startup.py bound, with its signals:

- the first SIGTERM or SIGINT starts a drain (operations/drain.py): no new requests, in-flight ones finish
  up to `--shutdown-timeout`, the rest are aborted, the engine stops, `run_server` returns (exit 0);
- a second SIGTERM or SIGINT exits at once (the engine process is killed first);
- when the supervisor gives up on the engine, uvicorn stops and `run_server` raises
  `EngineGaveUp` (exit 1).

It holds no state of its own beyond the uvicorn server it runs.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
import time
from pathlib import Path
from types import FrameType

import uvicorn

from freetoken.config import EngineConfig
from freetoken.errors import ConfigError, FreeTokenError
from freetoken.server.app import build_app
from freetoken.server.console import LoadBar, ready_block
from freetoken.server.context import ServingContext
from freetoken.server.operations.metrics import Metrics
from freetoken.server.process.messages import Ready
from freetoken.server.settings import ServerConfig
from freetoken.server.startup import Started, start
from freetoken.tokenizer import Tokenizer
from freetoken.tokenizer.cache import TokenizerCache
from freetoken.weights.sampling_defaults import SamplingDefaults, checkpoint_sampling_defaults
from freetoken.weights.source import base_model_note

log = logging.getLogger("freetoken.server")

GRACEFUL_SHUTDOWN_S = 5  # after a drain: how long uvicorn waits for responses still being sent


class EngineGaveUp(FreeTokenError):
    """The supervisor will not restart the engine: `ft serve` exits non-zero."""


def load_tokenizer(started: Started, server_config: ServerConfig, weights_cache: str | None = None) -> Tokenizer:
    """The model's tokenizer, with `--chat-template` applied (ConfigError names the flag); a
    GGUF's is read from the tokenizer cache under `--weights-cache` when it was built before."""
    if started.metadata is not None:
        tokenizer = Tokenizer.from_gguf_metadata(started.metadata, TokenizerCache.for_setting(weights_cache))
    else:
        tokenizer = Tokenizer.from_pretrained_dir(started.source.path)
    if server_config.chat_template is not None:
        path = Path(server_config.chat_template).expanduser()
        try:
            tokenizer.chat_template = path.read_text(encoding="utf-8")
        except OSError as err:
            raise ConfigError(f"--chat-template: cannot read {path} ({err.strerror})") from None
    return tokenizer


def model_sampling_defaults(started: Started, server_config: ServerConfig) -> SamplingDefaults:
    """The checkpoint's sampling defaults (`--sampling-defaults model`), or none."""
    if server_config.sampling_defaults == "none":
        return SamplingDefaults()
    return checkpoint_sampling_defaults(started.source, started.metadata)


class _Server(uvicorn.Server):
    """uvicorn with FreeToken's signals: the first one drains, a second one exits at once."""

    def __init__(self, config: uvicorn.Config, ctx: ServingContext) -> None:
        super().__init__(config)
        self.ctx = ctx
        self.gave_up: str | None = None
        self._signals = 0

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self._signals += 1
        name = signal.Signals(sig).name
        if self._signals > 1 or not self.started:
            log.warning("%s again: exiting now", name)
            self.ctx.client.kill_engine()
            self._captured_signals.append(sig)  # uvicorn re-raises it after its shutdown
            self.should_exit = self.force_exit = True
            return
        # A Python signal handler runs between bytecodes of the loop's thread: hand over to the loop.
        asyncio.get_event_loop().call_soon_threadsafe(self.ctx.begin_drain, name)

    def drained(self) -> None:
        self.should_exit = True

    def give_up(self, reason: str) -> None:
        self.gave_up = reason
        self.should_exit = True


class _UvicornNoise(logging.Filter):
    """uvicorn's "Uvicorn running on ..." comes before the model is ready and names an address
    that may not open (0.0.0.0): the ready block says where to connect, once it is true."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Uvicorn running on")


class _Console:
    """The loading bar and the ready block of one `ft serve` (server/console.py)."""

    def __init__(self, server_config: ServerConfig, started: Started, port: int) -> None:
        self.config = server_config
        self.started = started
        self.port = port
        self.bar = LoadBar(sys.stderr, started.served_name)
        self.readies = 0
        self.sampling = SamplingDefaults()  # shown in the ready block

    def ready(self, info: Ready) -> None:
        self.bar.clear()
        self.readies += 1
        if self.readies > 1:  # a restarted engine: the block was shown once
            log.info("engine process %d ready again: %s", info.pid, info.model_name)
            return
        text, fields = ready_block(
            self.started.served_name,
            self.config.host,
            self.port,
            architecture=info.architecture,
            context_length=info.context_length,
            api_key=self.config.api_key is not None,
            seconds=time.monotonic() - self.started.began,
            sampling=self.sampling,
            note=base_model_note(self.started.source.name),
        )
        log.info(text, extra=fields)


def run_server(engine_config: EngineConfig, server_config: ServerConfig, started: Started | None = None) -> None:
    """Serve until drained (returns) or the engine cannot be kept up (raises EngineGaveUp).
    Raises ConfigError / ModelLoadError before listening. `started` is what startup.start
    already did (`ft serve` calls it before importing this module); None: done here."""
    from freetoken.server.process.client import EngineClient

    if started is None:
        started = start(engine_config, server_config)
    port = started.sock.getsockname()[1]
    console = _Console(server_config, started, port)
    try:
        tokenizer = load_tokenizer(started, server_config, engine_config.weights_cache)
        served_name = started.served_name
        holder: list[_Server] = []
        client = EngineClient(
            engine_config,
            served_name=served_name,
            hang_timeout_s=server_config.engine_hang_timeout_s,
            load_timeout_s=server_config.load_timeout_s,
            on_give_up=lambda reason: holder[0].give_up(reason),
            early=started.engine,
            on_ready=console.ready,
            on_load_progress=console.bar.update,
        )
        console.sampling = model_sampling_defaults(started, server_config)
        ctx = ServingContext(
            client, tokenizer, server_config, Metrics(served_name), served_name, sampling_defaults=console.sampling
        )
        app = build_app(ctx, manage_client=True)
        config = uvicorn.Config(
            app,
            host=server_config.host,
            port=server_config.port,
            log_level="info",
            log_config=None,  # uvicorn's loggers go to the root handler: one format (utils/logs.py)
            access_log=False,  # the request log line (operations/request_log.py) replaces the access log
            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
            lifespan="on",
        )
        server = _Server(config, ctx)
    except BaseException:
        started.abandon()
        raise
    holder.append(server)
    ctx.on_drained = server.drained
    logging.getLogger("uvicorn.error").addFilter(_UvicornNoise())
    log.info(
        "listening on %s:%d; the engine process loads %s (/health answers 503 until it is ready)",
        server_config.host,
        port,
        served_name,
    )
    try:
        server.run(sockets=[started.sock])
    finally:
        console.bar.clear()
    if server.gave_up is not None:
        raise EngineGaveUp(server.gave_up)
