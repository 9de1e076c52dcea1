"""The expert-cache metric families of `--moe-strategy offload`, read from the `experts` section of
the engine status (models/experts.py `expert_status`).

Owns `freetoken_expert_cache_{hits,misses,evictions}` (the engine's running totals, exported as
gauges since the status document carries totals, not increments), `freetoken_expert_cache_bytes`
(held now), `freetoken_expert_cache_capacity_bytes` and `freetoken_expert_cache_loaded_bytes`
(decoded into the cache since start). All stay 0 for a resident or dense model. It does not talk
to the engine.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Gauge

_FIELDS = {
    "hits": "Expert lookups served from the expert cache (total since the engine started)",
    "misses": "Expert lookups that decoded the expert from its backing store (total)",
    "evictions": "Experts evicted from the expert cache (total)",
    "bytes": "Bytes the expert cache holds now",
    "capacity_bytes": "The expert cache's budget in bytes (--expert-cache-gb; resizable)",
    "loaded_bytes": "Bytes decoded into the expert cache since the engine started",
}


class ExpertMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.gauges = {
            key: Gauge(f"freetoken_expert_cache_{key}", text, registry=registry) for key, text in _FIELDS.items()
        }

    def update(self, status: dict[str, Any]) -> None:
        cache = (status.get("experts") or {}).get("cache") or {}
        for key, gauge in self.gauges.items():
            gauge.set(cache.get(key, 0))
