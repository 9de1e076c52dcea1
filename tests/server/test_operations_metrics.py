"""The `vllm:*` compatibility aliases on /metrics: every name routers and dashboards read is there
from the first scrape, labelled with the served model name, and moves under traffic -- the
running gauge and KV usage while a stream runs, the token, latency and prefix-cache counters
after requests (the second request of a shared prompt hits the cache)."""

from __future__ import annotations

import threading

from serving import ServeProcess

NAMES = (
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
    "vllm:time_to_first_token_seconds_count", "vllm:e2e_request_latency_seconds_count",
    "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
)
LONG = {"model": "default", "prompt": [5, 6, 7, 8] * 4, "max_tokens": 600, "temperature": 0, "ignore_eos": True, "stream": True}


def scrape(server: ServeProcess) -> dict[str, float]:
    with server.http() as c:
        text = c.get("/metrics").text
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("vllm:") and "{" in line:
            name, rest = line.split("{", 1)
            labels, value = rest.rsplit("} ", 1)
            assert 'model_name="' in labels, line
            if "le=" not in labels:
                values[name] = float(value)
    return values


def test_vllm_names_present_and_moving(server: ServeProcess) -> None:
    before = scrape(server)
    assert set(NAMES) <= set(before), sorted(set(NAMES) - set(before))
    seen_running = threading.Event()
    with server.http() as c, c.stream("POST", "/v1/completions", json=LONG) as r:
        for i, line in enumerate(r.iter_lines()):
            if i == 4:
                during = scrape(server)
                if during["vllm:num_requests_running"] >= 1 and during["vllm:kv_cache_usage_perc"] > 0:
                    seen_running.set()
    assert seen_running.is_set(), during
    prompt = {"model": "default", "prompt": [9, 10, 11, 12] * 8, "max_tokens": 4, "temperature": 0}
    with server.http() as c:
        for _ in range(2):
            assert c.post("/v1/completions", json=prompt).status_code == 200
    after = scrape(server)
    assert after["vllm:generation_tokens_total"] >= before["vllm:generation_tokens_total"] + 600 + 8
    assert after["vllm:prompt_tokens_total"] >= before["vllm:prompt_tokens_total"] + 16 + 64
    assert after["vllm:prefix_cache_queries_total"] >= before["vllm:prefix_cache_queries_total"] + 16 + 64
    assert after["vllm:prefix_cache_hits_total"] > before["vllm:prefix_cache_hits_total"]  # the repeat hit the cache
    for name in ("vllm:time_to_first_token_seconds_count", "vllm:e2e_request_latency_seconds_count"):
        assert after[name] == before[name] + 3, name
    assert after["vllm:num_requests_running"] == 0 and after["vllm:kv_cache_usage_perc"] == 0
    server.assert_balanced_idle()
