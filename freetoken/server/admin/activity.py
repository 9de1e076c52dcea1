"""`GET /admin/activity`: the dashboard's JSON beside `/health` and `/v1/cache/status`.

Owns `activity_document`: the serving context's tokens-per-second history and recent requests
(operations/activity.py) with the totals the metrics already count (requests by status, prompt,
cache-hit and generated tokens, prefix-cache misses by reason), read from the app's Prometheus
registry so there is one count of each. It asks the engine nothing: the page reads pools,
running and waiting from `/v1/cache/status`.
"""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import CollectorRegistry

from freetoken.server.context import ServingContext


def _samples(registry: CollectorRegistry, family: str) -> list[tuple[dict[str, str], float]]:
    """The `_total` samples of counter `family` (one per label set)."""
    return [
        (dict(s.labels), s.value)
        for metric in registry.collect()
        if metric.name == family
        for s in metric.samples
        if s.name == f"{family}_total"
    ]


def _total(registry: CollectorRegistry, family: str) -> int:
    return int(sum(value for _, value in _samples(registry, family)))


def activity_document(ctx: ServingContext) -> dict[str, Any]:
    registry = ctx.metrics.registry
    by_status: dict[str, int] = {}
    for labels, value in _samples(registry, "freetoken_requests"):
        by_status[labels["status"]] = by_status.get(labels["status"], 0) + int(value)
    misses = {labels["reason"]: int(value) for labels, value in _samples(registry, "freetoken_cache_misses") if value}
    prompt = _total(registry, "freetoken_prompt_tokens")
    cached = _total(registry, "freetoken_cache_hit_tokens")
    return {
        "time": time.time(),
        "model": ctx.served_name,
        "totals": {
            "requests": sum(by_status.values()),
            "served": by_status.get("200", 0),
            "by_status": by_status,
            "prompt_tokens": prompt,
            "cached_tokens": cached,
            "generated_tokens": _total(registry, "freetoken_generation_tokens"),
            "cache_hit_rate": cached / prompt if prompt else None,
            "miss_reasons": misses,
        },
        **ctx.activity.document(),
    }
