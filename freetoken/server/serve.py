"""`ft serve`: load the tokenizer, start the engine client, build the app, run uvicorn.

Owns the API process's start-up and shutdown: resolving `--model` (short name, .gguf file or
model directory), the tokenizer and the `--chat-template` override, the served model name, and
uvicorn's lifetime. Ctrl-C and SIGTERM are uvicorn's: it stops accepting, ends open streams after
a short grace period, and the app's lifespan stops the engine process. It holds no state of its own.
"""

from __future__ import annotations

import logging
from pathlib import Path

import uvicorn

from freetoken.config import EngineConfig
from freetoken.errors import ConfigError
from freetoken.server.app import build_app
from freetoken.server.context import ServingContext
from freetoken.server.metrics import Metrics
from freetoken.server.settings import ServerConfig
from freetoken.tokenizer import Tokenizer
from freetoken.weights.gguf_metadata import read_metadata
from freetoken.weights.source import resolve_model

log = logging.getLogger("freetoken.server")

GRACEFUL_SHUTDOWN_S = 5


def load_tokenizer(engine_config: EngineConfig, server_config: ServerConfig) -> tuple[Tokenizer, str]:
    """The model's tokenizer (with `--chat-template` applied) and the name it is served under."""
    source = resolve_model(engine_config.model)
    if source.kind == "gguf":
        tokenizer = Tokenizer.from_gguf_metadata(read_metadata(source.path))
    else:
        tokenizer = Tokenizer.from_pretrained_dir(source.path)
    if server_config.chat_template is not None:
        path = Path(server_config.chat_template).expanduser()
        try:
            tokenizer.chat_template = path.read_text(encoding="utf-8")
        except OSError as err:
            raise ConfigError(f"--chat-template: cannot read {path} ({err.strerror})") from None
    return tokenizer, server_config.served_model_name or source.name


def run_server(engine_config: EngineConfig, server_config: ServerConfig) -> None:
    """Serve until Ctrl-C / SIGTERM. Raises ConfigError / ModelLoadError before listening."""
    from freetoken.server.client import EngineClient

    engine_config.validate()
    server_config.validate()
    tokenizer, served_name = load_tokenizer(engine_config, server_config)
    client = EngineClient(engine_config, served_name=served_name)
    ctx = ServingContext(client, tokenizer, server_config, Metrics(), served_name)
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
    log.info("serving %s on http://%s:%d (the engine loads in the background; /health says when it is ready)",
             served_name, server_config.host, server_config.port)
    uvicorn.Server(config).run()
