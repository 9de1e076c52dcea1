"""`ft serve`: check the configuration, load the tokenizer, start the engine client, build the
app, run uvicorn, and exit with a status that says what happened.

Owns the API process's start-up and shutdown: resolving `--model` (short name, .gguf file or
model directory), the metadata-only preflight (preflight.py: a refused configuration raises
ConfigError before any engine process starts), the tokenizer and the `--chat-template` override,
the served model name, and uvicorn's lifetime with its signals:

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
from pathlib import Path
from types import FrameType

import uvicorn

from freetoken.config import EngineConfig
from freetoken.errors import ConfigError, FreeTokenError
from freetoken.server.app import build_app
from freetoken.server.context import ServingContext
from freetoken.server.operations.metrics import Metrics
from freetoken.server.preflight import model_facts, preflight
from freetoken.server.settings import ServerConfig
from freetoken.tokenizer import Tokenizer
from freetoken.weights.gguf_metadata import open_gguf
from freetoken.weights.source import resolve_model

log = logging.getLogger("freetoken.server")

GRACEFUL_SHUTDOWN_S = 5  # after a drain: how long uvicorn waits for responses still being sent


class EngineGaveUp(FreeTokenError):
    """The supervisor will not restart the engine: `ft serve` exits non-zero."""


def load_tokenizer(engine_config: EngineConfig, server_config: ServerConfig) -> tuple[Tokenizer, str]:
    """The model's tokenizer (with `--chat-template` applied) and the name it is served under.
    Runs the metadata-only preflight first (ConfigError names the flag)."""
    source = resolve_model(engine_config.model)
    # A GGUF file is checked whole (directory and metadata, no tensor data) before any engine starts.
    metadata = open_gguf(source.path).metadata if source.kind == "gguf" else None
    preflight(engine_config, model_facts(source, metadata))
    if metadata is not None:
        tokenizer = Tokenizer.from_gguf_metadata(metadata)
    else:
        tokenizer = Tokenizer.from_pretrained_dir(source.path)
    if server_config.chat_template is not None:
        path = Path(server_config.chat_template).expanduser()
        try:
            tokenizer.chat_template = path.read_text(encoding="utf-8")
        except OSError as err:
            raise ConfigError(f"--chat-template: cannot read {path} ({err.strerror})") from None
    return tokenizer, server_config.served_model_name or source.name


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


def run_server(engine_config: EngineConfig, server_config: ServerConfig) -> None:
    """Serve until drained (returns) or the engine cannot be kept up (raises EngineGaveUp).
    Raises ConfigError / ModelLoadError before listening."""
    from freetoken.server.process.client import EngineClient

    engine_config.validate()
    server_config.validate()
    tokenizer, served_name = load_tokenizer(engine_config, server_config)
    holder: list[_Server] = []
    client = EngineClient(
        engine_config, served_name=served_name, hang_timeout_s=server_config.engine_hang_timeout_s,
        load_timeout_s=server_config.load_timeout_s,
        on_give_up=lambda reason: holder[0].give_up(reason),
    )
    ctx = ServingContext(client, tokenizer, server_config, Metrics(served_name), served_name)
    app = build_app(ctx, manage_client=True)
    config = uvicorn.Config(
        app,
        host=server_config.host,
        port=server_config.port,
        log_level="info",
        access_log=False,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        lifespan="on",
    )
    server = _Server(config, ctx)
    holder.append(server)
    ctx.on_drained = server.drained
    log.info("serving %s on http://%s:%d (the engine loads in the background; /health says when it is ready)",
             served_name, server_config.host, server_config.port)
    server.run()
    if server.gave_up is not None:
        raise EngineGaveUp(server.gave_up)
