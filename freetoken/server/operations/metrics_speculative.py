"""The speculative-decoding metric families of `--speculative ngram`, read from the `speculative`
section of the engine status (engine/engine.py `Engine.status`).

Owns `freetoken_spec_drafted_tokens` and `freetoken_spec_accepted_tokens` (the engine's running
totals since it started, exported as gauges since the status document carries totals) and
`freetoken_spec_acceptance_rate` (accepted / drafted; 0 before any draft). All stay 0 with
speculation off. It does not talk to the engine.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Gauge


class SpeculativeMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.drafted = Gauge(
            "freetoken_spec_drafted_tokens",
            "Tokens drafted and verified (total since the engine started)",
            registry=registry,
        )
        self.accepted = Gauge(
            "freetoken_spec_accepted_tokens", "Drafted tokens the verification accepted (total)", registry=registry
        )
        self.rate = Gauge(
            "freetoken_spec_acceptance_rate", "Accepted / drafted tokens since the engine started", registry=registry
        )

    def update(self, status: dict[str, Any]) -> None:
        spec = status.get("speculative") or {}
        drafted, accepted = spec.get("drafted_tokens", 0), spec.get("accepted_tokens", 0)
        self.drafted.set(drafted)
        self.accepted.set(accepted)
        self.rate.set(accepted / drafted if drafted else 0.0)
