"""What every route needs: the engine client, the tokenizer, the settings, the metrics and the
recent activity (the dashboard's).

Owns `ServingContext` and the checks that come before any generation: the model name (404), the
engine's readiness (503), the drain gate (503 while shutting down) and the admission limit (429
with Retry-After). It holds no per-request state and never imports torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from freetoken.server.errors import APIError
from freetoken.server.operations.activity import Activity
from freetoken.server.operations.drain import DrainGate
from freetoken.server.operations.metrics import Metrics
from freetoken.server.process.messages import Ready
from freetoken.server.settings import ServerConfig
from freetoken.tokenizer import Tokenizer
from freetoken.weights.sampling_defaults import SamplingDefaults

if TYPE_CHECKING:
    from freetoken.server.process.client import EngineClient

DEFAULT_MODEL_ALIAS = "default"


@dataclass
class ServingContext:
    client: EngineClient
    tokenizer: Tokenizer
    config: ServerConfig
    metrics: Metrics
    served_name: str
    drain: DrainGate = field(default_factory=DrainGate)
    activity: Activity = field(default_factory=Activity)  # the dashboard's recent requests and tok/s
    on_drained: Callable[[], None] | None = None  # serve.py: stop the HTTP server once drained
    sampling_defaults: SamplingDefaults = field(default_factory=SamplingDefaults)  # the model's, for unset fields

    def begin_drain(self, why: str) -> bool:
        """Stop admitting and drain (SIGTERM, POST /admin/drain); False if already draining."""
        return self.drain.begin(self.client, self.config.shutdown_timeout_s, self.on_drained or (lambda: None), why)

    def check_model(self, name: str) -> None:
        if name not in (self.served_name, DEFAULT_MODEL_ALIAS):
            raise APIError(
                404,
                f"The model '{name}' does not exist; this server serves '{self.served_name}' (or use 'default')",
                param="model",
                code="model_not_found",
            )

    def ready_info(self) -> Ready:
        """The engine's model facts; 503 while it is loading or down."""
        info = self.client.info
        if self.client.state != "ready" or info is None:
            reason = self.client.reason or (
                "the engine is loading" if self.client.state == "loading" else "the engine is down"
            )
            raise APIError(
                503, f"engine unavailable: {reason}", code="engine_unavailable", headers={"Retry-After": "5"}
            )
        return info

    def check_capacity(self, new_requests: int) -> None:
        """Beyond --max-running-requests + --max-waiting-requests in flight: 429."""
        in_flight = self.client.num_in_flight
        limit = self.config.max_in_flight
        if in_flight + new_requests > limit:
            self.metrics.rejected.inc()
            raise APIError(
                429,
                f"the server is full ({in_flight} requests in flight, limit {limit} = --max-running-requests "
                "+ --max-waiting-requests); retry later",
                code="rate_limit_exceeded",
                headers={"Retry-After": "1"},
            )
