"""The HTTP server's own settings: one frozen `ServerConfig` built from `ft serve` flags.

Owns what the API process needs beyond the engine's `EngineConfig`: where to listen, the API key,
the served model name, the chat template override, the cache report switch, the admission
limit, the request-body limit, and the operations timeouts (engine load, engine hang, shutdown drain). It reads no environment variables and holds no state.
"""

from __future__ import annotations

from dataclasses import dataclass

from freetoken.errors import ConfigError
from freetoken.server.process.heartbeat import DEFAULT_HANG_TIMEOUT_S, MIN_HANG_TIMEOUT_S
from freetoken.server.process.supervisor import DEFAULT_LOAD_TIMEOUT_S, MIN_LOAD_TIMEOUT_S
from freetoken.tokenizer.reasoning import REASONING_PARSERS
from freetoken.tokenizer.tool_parsers import TOOL_PARSERS

# Defaults that live here, not beside the code that applies them (operations/drain.py,
# request_body.py): those import the web stack, and `ft serve` reads its settings before it.
DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0  # --shutdown-timeout
# 32 MiB: ~8M tokens of text, far past the context of any model served here (a 1M-token context is
# ~4 MiB of text), and room for a long agent conversation with tool results; small enough that a
# few concurrent bodies at the limit cost the API process little memory.
DEFAULT_MAX_REQUEST_BYTES = 32 * 1024 * 1024  # --max-request-bytes
MIN_MAX_REQUEST_BYTES = 1024


@dataclass(frozen=True)
class ServerConfig:
    """Flags of the API process. `max_running_requests` and `max_waiting_requests` are the
    engine's (same flags): their sum is how many requests may be in flight before a 429."""

    host: str = "127.0.0.1"
    port: int = 1919
    api_key: str | None = None
    served_model_name: str | None = None
    chat_template: str | None = None  # a path to a jinja2 file overriding the model's template
    enable_cache_report: bool = False
    max_running_requests: int = 16
    max_waiting_requests: int = 256
    tool_call_parser: str | None = None  # --tool-call-parser: a TOOL_PARSERS name (None: from the model)
    request_timeout_s: float | None = None  # --request-timeout: a generation request running longer ends with a 504
    responses_store_size: int = 1024  # --responses-store-size: responses kept for previous_response_id (LRU)
    responses_store_ttl_s: float = 3600.0  # --responses-store-ttl: and for how long
    reasoning_parser: str | None = None  # --reasoning-parser: think|none (None: from the model)
    sampling_defaults: str = "model"  # --sampling-defaults: model (the checkpoint's, for unset fields) | none
    allowed_origins: tuple[str, ...] = ()  # --allowed-origins: CORS origins ("*": any); empty = no CORS headers
    unprefixed_routes: bool = False  # --unprefixed-routes: the OpenAI routes also answer without /v1
    engine_hang_timeout_s: float = (
        DEFAULT_HANG_TIMEOUT_S  # --engine-hang-timeout: no engine heartbeat for this long = hung
    )
    load_timeout_s: float = (
        DEFAULT_LOAD_TIMEOUT_S  # --load-timeout: an engine process not Ready this long after its start is killed
    )
    shutdown_timeout_s: float = (
        DEFAULT_SHUTDOWN_TIMEOUT_S  # --shutdown-timeout: how long a drain waits for in-flight requests
    )
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES  # --max-request-bytes: a larger body is answered 413 unread

    def validate(self) -> None:
        """Raise ConfigError naming the flag that cannot work."""
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"--port must be in [0, 65535], got {self.port}")
        if self.api_key is not None and not self.api_key:
            raise ConfigError("--api-key must not be empty")
        if self.served_model_name is not None and not self.served_model_name.strip():
            raise ConfigError("--served-model-name must not be empty")
        if self.max_running_requests < 1:
            raise ConfigError(f"--max-running-requests must be at least 1, got {self.max_running_requests}")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_PARSERS:
            raise ConfigError(
                f"--tool-call-parser must be one of {', '.join(TOOL_PARSERS)}, got {self.tool_call_parser!r}"
            )
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ConfigError(
                f"--reasoning-parser must be one of {', '.join(REASONING_PARSERS)}, got {self.reasoning_parser!r}"
            )
        if self.sampling_defaults not in ("model", "none"):
            raise ConfigError(f"--sampling-defaults must be model or none, got {self.sampling_defaults!r}")
        if any(not o.strip() for o in self.allowed_origins):
            raise ConfigError("--allowed-origins: an origin must not be empty")
        if self.max_waiting_requests < 0:
            raise ConfigError(f"--max-waiting-requests must be >= 0, got {self.max_waiting_requests}")
        if self.request_timeout_s is not None and not 0 < self.request_timeout_s < float("inf"):
            raise ConfigError(f"--request-timeout must be a positive number of seconds, got {self.request_timeout_s}")
        if self.responses_store_size < 0:
            raise ConfigError(f"--responses-store-size must be >= 0, got {self.responses_store_size}")
        if not 0 < self.responses_store_ttl_s < float("inf"):
            raise ConfigError(
                f"--responses-store-ttl must be a positive number of seconds, got {self.responses_store_ttl_s}"
            )
        if not MIN_HANG_TIMEOUT_S <= self.engine_hang_timeout_s < float("inf"):
            raise ConfigError(
                f"--engine-hang-timeout must be at least {MIN_HANG_TIMEOUT_S:g} s (4 heartbeats), got {self.engine_hang_timeout_s}"
            )
        if not MIN_LOAD_TIMEOUT_S <= self.load_timeout_s < float("inf"):
            raise ConfigError(f"--load-timeout must be at least {MIN_LOAD_TIMEOUT_S:g} s, got {self.load_timeout_s}")
        if not 0 <= self.shutdown_timeout_s < float("inf"):
            raise ConfigError(f"--shutdown-timeout must be a number of seconds >= 0, got {self.shutdown_timeout_s}")
        if self.max_request_bytes < MIN_MAX_REQUEST_BYTES:
            raise ConfigError(
                f"--max-request-bytes must be at least {MIN_MAX_REQUEST_BYTES}, got {self.max_request_bytes}"
            )

    @property
    def max_in_flight(self) -> int:
        """Requests (choices) the server accepts at once; beyond it, 429."""
        return self.max_running_requests + self.max_waiting_requests
