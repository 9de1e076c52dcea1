"""KV memory features through a real `ft serve` on the tiny sliding-window model (window 7,
pages of 4, --enable-cache-report, --debug-kv): the cache report's miss reason and its metric,
and `POST /admin/cache/resize` (on a small server of its own, so that page numbers are known;
the requests a shrink must wait for are held in the engine by its test hold, `--test-hold`, so
they certainly hold their pages when it comes). Every test ends with the pools balanced and no
violation or engine restart during it."""

from __future__ import annotations

import itertools
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import API_KEY
from hold import EngineHold
from serving import ServeProcess, serving

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


SMALL_FLAGS = [
    "--page-size", "4", "--num-tokens", "128", "--max-running-requests", "2", "--max-waiting-requests", "2",
    "--max-prefill-length", "12", "--enable-cache-report", "--debug-kv", "--dtype", "float32", "--threads", "1",
]


@pytest.fixture
def small_hold(tmp_path: Path) -> EngineHold:
    return EngineHold(tmp_path / "hold")


@pytest.fixture
def small_server(tiny_gemma_dir: Path, small_hold: EngineHold, tmp_path: Path) -> Iterator[ServeProcess]:
    """A fresh server with a 32-page FULL pool: its first requests take pages 1, 2, ... in order."""
    with serving(str(tiny_gemma_dir), [*SMALL_FLAGS, *small_hold.flags], tmp_path / "small.log", api_key=API_KEY) as proc:
        proc.begin_test()
        yield proc


def resize(server: ServeProcess, body: object, key: str | None = API_KEY) -> httpx.Response:
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    return httpx.post(f"{server.base}/admin/cache/resize", json=body, headers=headers, timeout=60)


def balanced(server: ServeProcess) -> dict[str, Any]:
    status = server.cache_status()
    for name, pool in status["pools"].items():
        assert pool["capacity"] == pool["free"] + pool["cached"] + pool["in_use"] + pool["quarantined"], (name, pool)
    assert status["integrity"]["violations"] == 0
    return status


def test_resize_checks_its_body_then_grows_and_shrinks_under_load(small_server: ServeProcess, small_hold: EngineHold) -> None:
    assert resize(small_server, {"full_tokens": 256}, key=None).status_code == 401
    for body, param in [({"full_tokens": "256"}, "full_tokens"), ({"swa_tokens": 0}, "swa_tokens"),
                        ({"bogus": 1}, "bogus"), ({}, "full_tokens"), ({"full_tokens": 2}, "full_tokens")]:
        r = resize(small_server, body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    floor = small_server.cache_status()["floor"]
    r = resize(small_server, {"swa_tokens": (floor - 1) * 4})
    assert r.status_code == 409 and r.json()["error"]["param"] == "swa_tokens", r.text
    assert "floor" in r.json()["error"]["message"]
    r = resize(small_server, {"full_tokens": 256})
    assert r.status_code == 200 and r.json()["pools"]["full"] == {"capacity": 64, "tokens": 256, "pending_release": 0}
    status = balanced(small_server)["pools"]["full"]
    assert status["capacity"] == 64 and status["free"] == 64
    for _ in range(3):
        complete(small_server, fresh_prompt(40))  # the tree holds pages 1-33
    done: list[dict[str, Any]] = []
    runners = [threading.Thread(target=lambda p=p: done.append(complete(small_server, p, 60)))
               for p in (fresh_prompt(30), fresh_prompt(30))]  # 13 pages each at the hold: pages 34-59
    start = small_server.cache_status()["engine"]["tokens_generated"]
    small_hold.decode_after(20)  # each runner holds 30 + 20 tokens until the release
    try:
        for t in runners:
            t.start()
        end = time.monotonic() + 300  # a hang guard
        held = small_server.cache_status()
        while held["engine"]["tokens_generated"] - start < 40 and time.monotonic() < end:
            time.sleep(0.05)
            held = small_server.cache_status()
        assert held["engine"]["tokens_generated"] - start == 40 and held["engine"]["in_flight"] == 2, held["engine"]
        # 48 pages: above the floor (twice a runner's 23 pages), below pages the held runners hold
        r = resize(small_server, {"full_tokens": 48 * 4})
        assert r.status_code == 200, r.text
        pending = r.json()["pools"]["full"]["pending_release"]
        during = balanced(small_server)["pools"]["full"]
    finally:
        small_hold.release()
    assert pending > 0 and during["target"] == 48 and during["capacity"] > 48, (pending, during)  # converging, not done
    for t in runners:
        t.join(timeout=300)
    assert len(done) == 2
    status = small_server.wait_idle()["pools"]["full"]
    assert status["capacity"] == status["target"] == 48 and status["pending_release"] == 0, status
    small_server.assert_balanced_idle()


def test_a_shrink_drops_the_tree_path_above_it_and_the_miss_says_evicted(small_server: ServeProcess) -> None:
    y, x = fresh_prompt(40), fresh_prompt(24)
    complete(small_server, y)  # pages 1-10 (41 written tokens: 10 whole pages committed, 11 held)
    complete(small_server, x)  # pages 11-16 at most
    tree_x = small_server.cache_status()
    # Shrink to 13: X keeps pages 11-13 (its first 12 tokens), the rest of its path is dropped.
    r = resize(small_server, {"full_tokens": 13 * 4})
    assert r.status_code == 200 and r.json()["pools"]["full"]["pending_release"] == 0, (r.text, tree_x)
    again = complete(small_server, x + [5, 6, 7, 8])
    assert again == {"cached_tokens": 12, "matched_tokens": 12, "miss_reason": "evicted"}, again
    too_big = httpx.post(f"{small_server.base}/v1/completions", headers=small_server.headers, timeout=60,
                         json={"model": MODEL, "prompt": fresh_prompt(50), "max_tokens": 4})
    assert too_big.status_code == 400, too_big.text  # new admissions see the 13-page pool
    small_server.assert_balanced_idle()


PINNED_FLAGS = [*SMALL_FLAGS, "--max-pinned-tokens", "64", "--kv-cache-dtype", "int8"]


@pytest.fixture
def pinned_server(tiny_gemma_dir: Path, tmp_path: Path) -> Iterator[ServeProcess]:
    """A fresh 32-page server whose pins may hold 16 pages, with an int8 KV cache."""
    with serving(str(tiny_gemma_dir), PINNED_FLAGS, tmp_path / "pinned.log", api_key=API_KEY) as proc:
        proc.begin_test()
        yield proc


def message(server: ServeProcess, system: Any, user: str) -> dict[str, Any]:
    body = {"model": MODEL, "max_tokens": 2, "temperature": 0, "system": system,
            "messages": [{"role": "user", "content": user}]}
    with server.http() as c:
        r = c.post("/v1/messages", json=body)
        count = c.post("/v1/messages/count_tokens", json={k: body[k] for k in ("model", "system", "messages")})
    assert r.status_code == 200 and count.status_code == 200, (r.text, count.text)
    u = r.json()["usage"]
    assert u["input_tokens"] + u["cache_read_input_tokens"] + u["cache_creation_input_tokens"] == count.json()["input_tokens"], u
    return u


def flood(server: ServeProcess) -> None:
    """Fresh prompts of 16 pages each: eviction takes every unpinned page of the 32-page pool."""
    for _ in range(3):
        complete(server, fresh_prompt(60), max_tokens=2)


def test_cache_control_pins_the_system_prompt_through_eviction(pinned_server: ServeProcess) -> None:
    text = "You are a careful assistant. Be brief."
    pinned = [{"type": "text", "text": text, "cache_control": {"type": "ephemeral", "ttl": "1h"}}]
    first = message(pinned_server, pinned, "Hello there")
    created = first["cache_creation_input_tokens"]
    assert first["cache_read_input_tokens"] == 0 and created > 0 and created % 4 == 0, first
    pins = pinned_server.cache_status()["pins"]
    assert pins["made"] == 1 and pins["pinned_pages"] == created // 4, pins
    flood(pinned_server)
    again = message(pinned_server, pinned, "What time is it")
    assert again["cache_read_input_tokens"] == created and again["cache_creation_input_tokens"] == 0, again
    # The same system prompt without cache_control (a fresh one, or the pin would hit): evicted.
    plain = text.replace("careful", "patient")
    message(pinned_server, plain, "Hello there")
    flood(pinned_server)
    unpinned = message(pinned_server, plain, "What time is it")
    assert unpinned["cache_read_input_tokens"] < created and unpinned["cache_creation_input_tokens"] == 0, unpinned
    r = httpx.post(f"{pinned_server.base}/v1/messages", headers=pinned_server.headers, timeout=60, json={
        "model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "hi", "cache_control": {"type": "ephemeral", "ttl": "2h"}}]}]})
    assert r.status_code == 400 and "ttl" in r.json()["error"]["message"], r.text
    pinned_server.assert_balanced_idle()


def test_int8_cache_reports_its_bytes_per_token(pinned_server: ServeProcess, small_server: ServeProcess) -> None:
    int8, float32 = pinned_server.cache_status()["pools"], small_server.cache_status()["pools"]
    for kind in ("full", "swa"):
        assert float32[kind]["bytes_per_token"] > 3 * int8[kind]["bytes_per_token"] > 0, (kind, int8, float32)


def test_prompt_cache_key_pins_the_system_message(pinned_server: ServeProcess) -> None:
    system = {"role": "system", "content": "You are a careful assistant. Be brief."}

    def chat(user: str) -> dict[str, Any]:
        with pinned_server.http() as c:
            r = c.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 2, "temperature": 0,
                                                     "prompt_cache_key": "agent-1",
                                                     "messages": [system, {"role": "user", "content": user}]})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]

    chat("Hello there")
    pins = pinned_server.cache_status()["pins"]
    assert pins["made"] == 1 and pins["pinned_pages"] > 0, pins
    flood(pinned_server)
    assert chat("What time is it")["cached_tokens"] == 4 * pins["pinned_pages"]
    pinned_server.assert_balanced_idle()
