"""Prometheus metrics of the server, in a registry the app owns (no global default registry).

Owns the `freetoken_*` metric families: requests by endpoint and status, prompt / generated /
cache-hit tokens, time-to-first-token and latency histograms, and gauges refreshed at scrape time
from the engine status (pool pages by state, audits, violations, quarantined pages, engine
restarts, requests in flight, engine up). It does not talk to the engine itself: the app passes
the status document in.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
POOL_STATES = ("capacity", "free", "cached", "in_use", "quarantined")


class Metrics:
    """One app's metrics. `render()` is the `/metrics` body."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("freetoken_requests", "HTTP generation requests by endpoint and status", ["endpoint", "status"], registry=r)
        self.rejected = Counter("freetoken_requests_rejected_full", "Requests refused with 429 (queue full)", registry=r)
        self.prompt_tokens = Counter("freetoken_prompt_tokens", "Prompt tokens of served requests", registry=r)
        self.generation_tokens = Counter("freetoken_generation_tokens", "Tokens generated", registry=r)
        self.cache_hit_tokens = Counter("freetoken_cache_hit_tokens", "Prompt tokens served from the prefix cache", registry=r)
        self.cache_misses = Counter(
            "freetoken_cache_misses", "Prompts by why their prefix-cache hit stopped (kv/miss.py; diverged_at_token N counts as diverged)",
            ["reason"], registry=r,
        )
        self.ttft = Histogram("freetoken_time_to_first_token_seconds", "Time to the first generated token", registry=r, buckets=_LATENCY_BUCKETS)
        self.latency = Histogram("freetoken_request_latency_seconds", "Time from request to its last token", registry=r, buckets=_LATENCY_BUCKETS)
        self.in_flight = Gauge("freetoken_requests_in_flight", "Requests the engine client holds", registry=r)
        self.engine_up = Gauge("freetoken_engine_up", "1 while the engine process is ready", registry=r)
        self.engine_restarts = Gauge("freetoken_engine_restarts", "Engine process restarts since the server started", registry=r)
        self.pool_pages = Gauge("freetoken_kv_pool_pages", "KV pool pages by pool and state", ["pool", "state"], registry=r)
        self.audits = Gauge("freetoken_kv_audits", "KV audits run by the current engine process", registry=r)
        self.violations = Gauge("freetoken_kv_audit_violations", "Failed KV audits since the engine started", registry=r)
        self.quarantined = Gauge("freetoken_kv_quarantined_pages", "KV pages quarantined after an integrity failure", registry=r)
        self.preemptions = Gauge("freetoken_preemptions", "Requests preempted by the scheduler", registry=r)

    def record_request(
        self,
        endpoint: str,
        status: int,
        *,
        prompt_tokens: int = 0,
        completion_tokens: int = 0,
        cached_tokens: int = 0,
        miss_reasons: Sequence[str] = (),
        ttft_s: float | None = None,
        latency_s: float | None = None,
    ) -> None:
        self.requests.labels(endpoint=endpoint, status=str(status)).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(completion_tokens)
        self.cache_hit_tokens.inc(cached_tokens)
        for reason in miss_reasons:
            self.cache_misses.labels(reason=reason.split("_at_token", 1)[0]).inc()
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
        if latency_s is not None:
            self.latency.observe(latency_s)

    def update_engine(self, *, up: bool, restarts: int, in_flight: int, status: dict[str, Any] | None) -> None:
        """Refresh the gauges from the client's counters and (when the engine answered) its status."""
        self.engine_up.set(1 if up else 0)
        self.engine_restarts.set(restarts)
        self.in_flight.set(in_flight)
        if status is None:
            return
        for pool, counts in (status.get("pools") or {}).items():
            for state in POOL_STATES:
                if state in counts:
                    self.pool_pages.labels(pool=pool, state=state).set(counts[state])
        integrity = status.get("integrity") or {}
        self.audits.set(integrity.get("audits", 0))
        self.violations.set(integrity.get("violations", 0))
        self.quarantined.set(integrity.get("quarantined_pages", 0))
        self.preemptions.set(status.get("preemptions", 0))

    def render(self) -> bytes:
        return generate_latest(self.registry)
