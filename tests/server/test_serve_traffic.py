"""Traffic through a real `ft serve` on the tiny sliding-window model (window 7, page 4, prefill
chunks of 12, --debug-kv): the seed's overlap over HTTP with its ablation rows, a concurrent
agent soak, mid-stream disconnects and a full queue. Every test ends with the pools balanced and
no violation or engine restart during it.

The seed test reaches the key step of DESIGN.md §3 "Known failure" and proves it from what the
server shows. Every A is fresh (its first page is unique to the test), so A's hit is 0 and A's
first 12-token chunk commits its head page (positions 0-3) as a tombstone: 0-3 are out of the
window of that chunk's end. B shares A's first 5 tokens and has 11 of its own (16 > the 12-token
budget), so once admitted B's first chunk never samples and is committed at once. Then:

- B's reported hit is 0 while the head page is in the tree: the head was a tombstone (a live
  head page would be a 4-token hit);
- B's first chunk covers at least 8 tokens (12 minus A's last chunk of 4, or a whole budget
  beside A's decode), so it reaches B's own page 1 and commits it beneath the head;
- A is admitted before B and still holds pages after B's response (`in_use > 0` with only A in
  flight), so A held the head through B's commit and B's `b_max >= 2` decode steps;
- a probe after both ends hits the head page: a commit of B's prompt made while B still held
  its page 0 live (its first chunk) healed it at the new branch point -- A's and B's final
  commits hold no live head page any more -- so B's prefill really was committed beneath the
  head, not only its finish.

What no HTTP surface shows is *which step* B's chunk shared with A (A's last prefill chunk or an
early decode step); the engine test (`tests/engine/test_engine_seed.py`) pins that exact step.
"""

from __future__ import annotations

import itertools
import json
import threading
from typing import Any

import pytest
from serving import ServeProcess

MODEL = "tiny-gemma"
A_LEN = 196  # 16 chunks of 12, then a last chunk of 4 that leaves B 8 tokens of the step's budget
SHARED = 5
_heads = itertools.count()


def fresh_a_prompt(length: int = A_LEN) -> list[int]:
    """A prompt no other test's request shares a page with: its first page is unique."""
    k = next(_heads)
    head = [319, 318, 300 + k % 17, 200 + k // 17]  # tokens no other test's prompt starts with
    return head + [10 + (i * 37) % 280 for i in range(length - len(head))]


def b_prompt_for(a_prompt: list[int]) -> list[int]:
    return a_prompt[:SHARED] + [290 + i for i in range(11)]  # 16 tokens: its first chunk never samples


class Streamer(threading.Thread):
    """Streams one completion in the background; `done` is set when its stream ended."""

    def __init__(self, server: ServeProcess, body: dict[str, Any], stop_after: int | None = None) -> None:
        super().__init__(daemon=True)
        self.stop_after = stop_after  # events read before hanging up mid-stream
        self.hangup = threading.Event()  # set: hang up at the next event
        self.server, self.body = server, {**body, "stream": True}
        self.events: list[dict[str, Any]] = []
        self.got_done = False
        self.done = threading.Event()
        self.first = threading.Event()

    def run(self) -> None:
        try:
            with self.server.http() as c, c.stream("POST", "/v1/completions", json=self.body) as r:
                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        self.got_done = True
                        continue
                    self.events.append(json.loads(line[6:]))
                    self.first.set()
                    if self.hangup.is_set() or self.stop_after is not None and len(self.events) >= self.stop_after:
                        return  # leaving the `with` closes the connection
        finally:
            self.first.set()
            self.done.set()


def wait_in_flight(server: ServeProcess, n: int) -> None:
    """Until the API process has handed `n` requests to the engine (a hang guard of ~30 s)."""
    with server.http() as c:
        for _ in range(3000):
            if c.get("/health").json().get("in_flight", 0) >= n:
                return
            threading.Event().wait(0.01)
    raise AssertionError(f"never saw {n} requests in flight")


def complete(server: ServeProcess, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    with server.http() as c:
        r = c.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                            "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()


def a_body(prompt: list[int], max_tokens: int) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}


@pytest.mark.parametrize("b_max", [4, 2])
def test_seed_overlap_over_http(server: ServeProcess, b_max: int) -> None:
    """DESIGN.md "Known failure", with its preconditions checked (see the module docstring)."""
    a_prompt = fresh_a_prompt()
    b_prompt = b_prompt_for(a_prompt)
    # A cannot end before the test hangs it up: 600 decode steps against B's few.
    server.wait_idle()  # nothing else in flight: the first request /health counts is A
    a = Streamer(server, a_body(a_prompt, 600))
    a.start()
    wait_in_flight(server, 1)  # A's AddRequest went out first: B queues behind it, never before it
    b = complete(server, b_prompt, b_max)
    assert b["choices"][0]["finish_reason"] == "length" and b["usage"]["completion_tokens"] == b_max
    assert b["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, "A's head must be a tombstone when B is admitted"
    during = server.cache_status()  # after B's response, so after B's finish in the engine
    assert during["engine"]["in_flight"] == 1 and during["pools"]["full"]["in_use"] > 0, (
        "A must still hold its pages after B ended", during)
    assert not a.done.is_set() and a.events, "A streams on beside B"
    a.hangup.set()
    a.join(timeout=300)
    assert not a.is_alive() and not a.got_done and not any("error" in e for e in a.events), a.events[-1:]
    server.assert_balanced_idle()
    probe = complete(server, a_prompt[:4] + [291, 292, 293, 294, 295, 296, 297, 298], 1)  # page 1 matches no one
    assert probe["usage"]["prompt_tokens_details"]["cached_tokens"] == 4, (
        "no live head: B's prefill chunk was never committed (or the head's protected window was evicted since)")
    with server.http() as c:
        assert c.get("/health").status_code == 200
    server.assert_balanced_idle()


@pytest.mark.parametrize(
    "name,share,b_max,after",
    [
        ("b_max_tokens_1", SHARED, 1, False),
        ("b_max_tokens_8", SHARED, 8, False),
        ("b_shares_a_long_prefix", 150, 4, False),
        ("b_shares_nothing", 0, 4, False),
        ("b_after_a", SHARED, 4, True),
    ],
)
def test_seed_ablation_rows_over_http(server: ServeProcess, name: str, share: int, b_max: int, after: bool) -> None:
    a_prompt = fresh_a_prompt(200)
    b_prompt = a_prompt[:share] + [290 + i for i in range(16 - min(share, 5))]
    server.wait_idle()
    a = Streamer(server, a_body(a_prompt, 48))
    a.start()
    if after:
        a.join(timeout=600)
        assert not a.is_alive()
    else:
        wait_in_flight(server, 1)  # A is queued or prefilling: B arrives during A's prefill or decode
    b = complete(server, b_prompt, b_max)
    assert b["choices"][0]["finish_reason"] == "length" and b["usage"]["completion_tokens"] == b_max
    if share == 0:
        assert b["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    a.join(timeout=600)
    assert not a.is_alive() and a.got_done and not any("error" in e for e in a.events), a.events[-1:]
    with server.http() as c:
        assert c.get("/health").status_code == 200
    server.assert_balanced_idle()


SYSTEM = " ".join(["You are a careful coding agent. Use the tools; answer in JSON; check the weather in Paris."] * 4)


def test_concurrent_agent_soak(server: ServeProcess) -> None:
    """4 conversations over one long system prompt, 4 turns each, at once."""
    errors: list[str] = []
    cached: dict[int, list[int]] = {}

    def conversation(k: int) -> None:
        messages: list[dict[str, str]] = [{"role": "system", "content": SYSTEM}]
        cached[k] = []
        with server.http() as c:
            for turn in range(4):
                messages.append({"role": "user", "content": f"conversation {k}, turn {turn}: what now?"})
                body = {"model": MODEL, "messages": messages, "max_tokens": 6, "temperature": 0.8, "seed": k * 10 + turn}
                r = c.post("/v1/chat/completions", json=body)
                if r.status_code != 200:
                    errors.append(r.text)
                    return
                out = r.json()
                cached[k].append(out["usage"]["prompt_tokens_details"]["cached_tokens"])
                messages.append({"role": "assistant", "content": out["choices"][0]["message"]["content"]})

    threads = [threading.Thread(target=conversation, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not errors, errors[:2]
    assert all(len(v) == 4 for v in cached.values())
    assert all(all(hit > 0 for hit in v[1:]) for v in cached.values()), cached
    with server.http() as c:
        assert c.get("/health").status_code == 200
    server.assert_balanced_idle()


def requests_with_status(server: ServeProcess, status: int) -> float:
    with server.http() as c:
        text = c.get("/metrics").text
    prefix = f'freetoken_requests_total{{endpoint="completions",status="{status}"}} '
    return sum(float(line[len(prefix):]) for line in text.splitlines() if line.startswith(prefix))


LONG = {"model": MODEL, "prompt": [5, 6, 7, 8] * 4, "max_tokens": 1000, "temperature": 0, "ignore_eos": True}


def test_mid_stream_disconnects_release_pages(server: ServeProcess) -> None:
    before = requests_with_status(server, 499)
    streams = [Streamer(server, LONG, stop_after=3) for _ in range(4)]
    for s in streams:
        s.start()
    for s in streams:
        s.join(timeout=300)
        assert len(s.events) == 3 and not s.got_done
    server.assert_balanced_idle()
    assert requests_with_status(server, 499) - before == 4  # each was cut off (and aborted) mid-stream
    assert complete(server, [5, 6, 7], 2)["choices"][0]["finish_reason"] == "length"  # still serving


def test_full_queue_gets_429(server: ServeProcess) -> None:
    """6 long streams fill 4 running + 2 waiting slots; a 7th request gets 429 with Retry-After."""
    streams = [Streamer(server, LONG) for _ in range(6)]
    for s in streams:
        s.start()
    wait_in_flight(server, 6)
    with server.http() as c:
        full = c.post("/v1/completions", json={**LONG, "max_tokens": 1})
    for s in streams:
        s.hangup.set()
    for s in streams:
        s.join(timeout=600)
    assert full.status_code == 429, full.text
    assert full.headers["retry-after"] and full.json()["error"]["type"] == "rate_limit_error"
    server.assert_balanced_idle()
