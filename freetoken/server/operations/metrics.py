"""Prometheus metrics of the server, in a registry the app owns (no global default registry).

Owns the `freetoken_*` metric families: requests by endpoint and status, prompt / generated /
cache-hit tokens, time-to-first-token and latency histograms, and gauges refreshed at scrape time
from the engine status (pool pages by state, audits, violations, quarantined pages, engine
restarts, requests in flight, engine up, heartbeat), and the compatibility aliases under vLLM's
names (`vllm:*`, labelled `model_name`, as routers, autoscalers and Grafana dashboards built for
vLLM read them; docs/operations.md lists them). It does not talk to the engine itself: the app
passes the status document in.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from freetoken.server.operations.metrics_disk import DiskMetrics
from freetoken.server.operations.metrics_experts import ExpertMetrics
from freetoken.server.operations.metrics_speculative import SpeculativeMetrics

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
POOL_STATES = ("capacity", "free", "cached", "in_use", "quarantined")


class VllmAliases:
    """vLLM's metric names (v1 engine) over the same numbers as the `freetoken_*` families."""

    def __init__(self, r: CollectorRegistry, model_name: str) -> None:
        self.model_name = model_name
        m = ["model_name"]
        self.running = Gauge("vllm:num_requests_running", "Requests in the engine's running batch", m, registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled", m, registry=r)
        self.kv_usage = Gauge(
            "vllm:kv_cache_usage_perc",
            "KV cache usage (FULL pool pages held by requests); 1 = 100 percent",
            m,
            registry=r,
        )
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens processed", m, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generation tokens processed", m, registry=r)
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds", "Time to first token", m, registry=r, buckets=_LATENCY_BUCKETS
        )
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds", "End-to-end request latency", m, registry=r, buckets=_LATENCY_BUCKETS
        )
        self.cache_queries = Counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in prompt tokens", m, registry=r
        )
        self.cache_hits = Counter("vllm:prefix_cache_hits", "Prefix cache hits, in prompt tokens", m, registry=r)
        for metric in (
            self.running,
            self.waiting,
            self.kv_usage,
            self.prompt_tokens,
            self.generation_tokens,
            self.ttft,
            self.e2e,
            self.cache_queries,
            self.cache_hits,
        ):
            metric.labels(model_name=model_name)  # present (at 0) from the first scrape

    def record(self, prompt: int, completion: int, cached: int, ttft_s: float | None, latency_s: float | None) -> None:
        name = self.model_name
        self.prompt_tokens.labels(model_name=name).inc(prompt)
        self.generation_tokens.labels(model_name=name).inc(completion)
        self.cache_queries.labels(model_name=name).inc(prompt)
        self.cache_hits.labels(model_name=name).inc(cached)
        if ttft_s is not None:
            self.ttft.labels(model_name=name).observe(ttft_s)
        if latency_s is not None:
            self.e2e.labels(model_name=name).observe(latency_s)

    def update(self, status: dict[str, Any]) -> None:
        name = self.model_name
        engine = status.get("engine") or {}
        self.running.labels(model_name=name).set(engine.get("running", 0))
        self.waiting.labels(model_name=name).set(engine.get("waiting", 0))
        full = (status.get("pools") or {}).get("full") or {}
        capacity = full.get("capacity") or 0
        self.kv_usage.labels(model_name=name).set(full.get("in_use", 0) / capacity if capacity else 0.0)


class Metrics:
    """One app's metrics. `render()` is the `/metrics` body."""

    def __init__(self, model_name: str = "") -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.vllm = VllmAliases(r, model_name)
        self.experts = ExpertMetrics(r)
        self.speculative = SpeculativeMetrics(r)
        self.disk = DiskMetrics(r)
        self.requests = Counter(
            "freetoken_requests", "HTTP generation requests by endpoint and status", ["endpoint", "status"], registry=r
        )
        self.rejected = Counter(
            "freetoken_requests_rejected_full", "Requests refused with 429 (queue full)", registry=r
        )
        self.prompt_tokens = Counter("freetoken_prompt_tokens", "Prompt tokens of served requests", registry=r)
        self.generation_tokens = Counter("freetoken_generation_tokens", "Tokens generated", registry=r)
        self.cache_hit_tokens = Counter(
            "freetoken_cache_hit_tokens", "Prompt tokens served from the prefix cache", registry=r
        )
        self.cache_misses = Counter(
            "freetoken_cache_misses",
            "Prompts by why their prefix-cache hit stopped (kv/miss.py; diverged_at_token N counts as diverged)",
            ["reason"],
            registry=r,
        )
        self.ttft = Histogram(
            "freetoken_time_to_first_token_seconds",
            "Time to the first generated token",
            registry=r,
            buckets=_LATENCY_BUCKETS,
        )
        self.latency = Histogram(
            "freetoken_request_latency_seconds",
            "Time from request to its last token",
            registry=r,
            buckets=_LATENCY_BUCKETS,
        )
        self.in_flight = Gauge("freetoken_requests_in_flight", "Requests the engine client holds", registry=r)
        self.engine_up = Gauge("freetoken_engine_up", "1 while the engine process is ready", registry=r)
        self.engine_restarts = Gauge(
            "freetoken_engine_restarts", "Engine process restarts since the server started", registry=r
        )
        self.pool_pages = Gauge(
            "freetoken_kv_pool_pages", "KV pool pages by pool and state", ["pool", "state"], registry=r
        )
        self.audits = Gauge("freetoken_kv_audits", "KV audits run by the current engine process", registry=r)
        self.violations = Gauge(
            "freetoken_kv_audit_violations", "Failed KV audits since the engine started", registry=r
        )
        self.quarantined = Gauge(
            "freetoken_kv_quarantined_pages", "KV pages quarantined after an integrity failure", registry=r
        )
        self.preemptions = Gauge("freetoken_preemptions", "Requests preempted by the scheduler", registry=r)
        self.engine_hangs = Gauge(
            "freetoken_engine_hangs", "Engine processes killed for missing their heartbeat", registry=r
        )
        self.heartbeat_max_gap = Gauge(
            "freetoken_engine_heartbeat_max_gap_seconds",
            "Longest wait between two heartbeats of the current engine process",
            registry=r,
        )

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
        self.vllm.record(prompt_tokens, completion_tokens, cached_tokens, ttft_s, latency_s)

    def update_engine(
        self,
        *,
        up: bool,
        restarts: int,
        in_flight: int,
        status: dict[str, Any] | None,
        hangs: int = 0,
        heartbeat_max_gap_s: float = 0.0,
    ) -> None:
        """Refresh the gauges from the client's counters and (when the engine answered) its status."""
        self.engine_up.set(1 if up else 0)
        self.engine_restarts.set(restarts)
        self.in_flight.set(in_flight)
        self.engine_hangs.set(hangs)
        self.heartbeat_max_gap.set(heartbeat_max_gap_s)
        if status is None:
            return
        self.vllm.update(status)
        self.experts.update(status)
        self.speculative.update(status)
        self.disk.update(status)
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
