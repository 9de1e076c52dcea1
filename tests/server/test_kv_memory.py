"""KV memory features through a real `ft serve` on the tiny sliding-window model (window 7,
pages of 4, --enable-cache-report, --debug-kv): the cache report's miss reason and its metric.
Every test ends with the pools balanced and no violation or engine restart during it."""

from __future__ import annotations

import itertools
import re
from typing import Any

from serving import ServeProcess

MODEL = "tiny-gemma"
_heads = itertools.count()


def fresh_prompt(length: int) -> list[int]:
    """A prompt whose first token no other test's prompt starts with (317 is this file's)."""
    k = next(_heads)
    return [317, 311, 300 + k % 17, 200 + k // 17] + [10 + (i * 41) % 280 for i in range(length - 4)]


def complete(server: ServeProcess, prompt: list[int], max_tokens: int = 2) -> dict[str, Any]:
    with server.http() as c:
        r = c.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens,
                                            "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]


def miss_count(server: ServeProcess, reason: str) -> float:
    with server.http() as c:
        text = c.get("/metrics").text
    m = re.search(rf'^freetoken_cache_misses_total{{reason="{reason}"}} (\S+)$', text, re.M)
    return 0.0 if m is None else float(m.group(1))


def test_miss_reasons_and_their_metric(server: ServeProcess) -> None:
    a = fresh_prompt(40)
    first = complete(server, a)
    assert first == {"cached_tokens": 0, "matched_tokens": 0, "miss_reason": "diverged_at_token 0"}, first
    capped_before = miss_count(server, "capped")
    again = complete(server, a)
    # All 10 pages are in the tree; the hit stops at the cap floor_to_page(40 - 1) = 36.
    assert again == {"cached_tokens": 36, "matched_tokens": 40, "miss_reason": "capped"}, again
    assert miss_count(server, "capped") == capped_before + 1
    # A's first 5 pages are in the tree, but a commit keeps live SWA entries only in the window
    # before each prefill chunk's end (12, 24, 36, 40): the window before 20 and before 16 has
    # page 3 tombstoned, the one before 12 is live (a completion marks no boundary).
    window_before = miss_count(server, "window_evicted")
    head = complete(server, a[:20] + [290 + i for i in range(9)])
    assert head == {"cached_tokens": 12, "matched_tokens": 20, "miss_reason": "window_evicted"}, head
    assert miss_count(server, "window_evicted") == window_before + 1
    # Leaving A's path inside page 9: the window before 36 is live, no path goes past token 38.
    diverged_before = miss_count(server, "diverged")
    fork = complete(server, a[:38] + [299] * 6)
    assert fork == {"cached_tokens": 36, "matched_tokens": 36, "miss_reason": "diverged_at_token 38"}, fork
    assert miss_count(server, "diverged") == diverged_before + 1
    server.assert_balanced_idle()
