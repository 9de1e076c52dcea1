"""The dashboard over real HTTP on the shared `ft serve` (tiny Gemma, an API key): `GET /` is the
page (HTML, no key needed, nothing loaded from elsewhere), `GET /admin/activity` is behind the key
and has the shape the page reads, and a request shows up in it (its line in `recent`, its tokens
in the tok/s history and the totals). Other unknown paths still answer the JSON 404. Nothing is
timed: the history is polled with a generous deadline."""

from __future__ import annotations

import re
import time

import httpx
from serving import ServeProcess

CHAT = {"model": "default", "messages": [{"role": "user", "content": "Hello dashboard"}], "max_tokens": 5,
        "temperature": 0, "ignore_eos": True}


def test_root_serves_the_page_without_a_key(server: ServeProcess) -> None:
    r = httpx.get(f"{server.base}/", timeout=30)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/html")
    assert "<title>FreeToken</title>" in r.text and 'id="chat-input"' in r.text
    assert "default-src 'self'" in r.headers["content-security-policy"]
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", r.text)  # no CDN, no external fonts
    assert '<link rel="icon" href="data:,">' in r.text  # the browser asks for no /favicon.ico (a 404 line in the log)
    for path in ("/admin/activity", "/v1/cache/status", "/v1/chat/completions"):
        assert path in r.text  # what the page reads
    missing = httpx.get(f"{server.base}/no-such-page", timeout=30)
    assert missing.status_code == 404 and missing.json()["error"]["code"] is not None


def test_activity_needs_the_key(server: ServeProcess) -> None:
    r = httpx.get(f"{server.base}/admin/activity", timeout=30)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    wrong = httpx.get(f"{server.base}/admin/activity", headers={"Authorization": "Bearer nope"}, timeout=30)
    assert wrong.status_code == 401


def test_activity_shape_and_a_request_in_it(server: ServeProcess) -> None:
    with server.http() as c:
        before = c.get("/admin/activity").json()
        answer = c.post("/v1/chat/completions", json=CHAT)
        assert answer.status_code == 200, answer.text
        usage = answer.json()["usage"]
        doc = c.get("/admin/activity").json()
    assert doc["model"] == before["model"] and isinstance(doc["time"], float)
    totals = doc["totals"]
    assert set(totals) >= {"requests", "served", "by_status", "prompt_tokens", "cached_tokens", "generated_tokens",
                           "cache_hit_rate", "miss_reasons"}
    assert totals["served"] == before["totals"]["served"] + 1
    assert totals["generated_tokens"] == before["totals"]["generated_tokens"] + 5
    assert totals["prompt_tokens"] == before["totals"]["prompt_tokens"] + usage["prompt_tokens"]
    assert 0.0 <= totals["cache_hit_rate"] <= 1.0 and all(n > 0 for n in totals["miss_reasons"].values())
    last = doc["recent"][0]
    assert last["endpoint"] == "chat" and last["status"] == 200 and last["finish_reason"] == "length"
    assert (last["prompt_tokens"], last["completion_tokens"]) == (usage["prompt_tokens"], 5)
    assert last["cached_tokens"] == usage["prompt_tokens_details"]["cached_tokens"]
    assert 0 < last["ttft_s"] <= last["latency_s"] and last["at"] <= doc["time"]
    assert len(doc["recent"]) <= 50
    throughput = doc["throughput"]
    assert throughput["bucket_s"] > 0 and len(throughput["series"]) == round(600 / throughput["bucket_s"])
    # the request's tokens land in the history once their bucket is complete
    end = time.monotonic() + 60
    series = throughput["series"]
    while time.monotonic() < end and sum(d for _, d in series[-10:]) == 0:
        time.sleep(0.5)
        with server.http() as c:
            series = c.get("/admin/activity").json()["throughput"]["series"]
    assert sum(d for _, d in series) * throughput["bucket_s"] >= 5
    assert all(p >= 0 and d >= 0 for p, d in series)
    server.assert_balanced_idle()
