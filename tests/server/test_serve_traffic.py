"""Traffic through a real `ft serve` on the tiny sliding-window model (window 7, page 4, prefill
chunks of 12, --debug-kv): the seed's overlap over HTTP with its ablation rows, a concurrent
agent soak, mid-stream disconnects and a full queue. Every test ends with the pools balanced."""

from __future__ import annotations

import json
import threading
from typing import Any

import httpx
import pytest
from serving import ServeProcess, assert_balanced_idle

MODEL = "tiny-gemma"
A_PROMPT = [10 + (i * 37) % 300 for i in range(200)]  # ~28 windows of 7; 17 prefill chunks of 12


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


def overlap(server: ServeProcess, b_prompt: list[int], b_max: int, *, b_after_a: bool = False) -> tuple[Streamer, dict[str, Any], bool]:
    a = Streamer(server, {"model": MODEL, "prompt": A_PROMPT, "max_tokens": 48, "temperature": 0, "ignore_eos": True})
    a.start()
    if b_after_a:
        a.join()
    else:
        wait_in_flight(server, 1)  # A is queued or prefilling: B arrives during A's prefill
    b = complete(server, b_prompt, b_max)
    a_still_streaming = not a.done.is_set()
    a.join()
    assert a.got_done and not any("error" in e for e in a.events), a.events[-1:]
    assert b["choices"][0]["finish_reason"] == "length" and b["usage"]["completion_tokens"] == b_max
    return a, b, a_still_streaming


@pytest.mark.parametrize("b_max", [4, 2])
def test_seed_overlap_over_http(server: ServeProcess, b_max: int) -> None:
    """DESIGN.md "Known failure": B shares A's first 5 tokens and finishes while A streams."""
    _, _, a_still_streaming = overlap(server, A_PROMPT[:5] + [301, 302, 303], b_max)
    assert a_still_streaming, "B must finish while A is still streaming"
    with server.http() as c:
        assert c.get("/health").status_code == 200
    assert_balanced_idle(server.wait_idle())


@pytest.mark.parametrize(
    "name,b_prompt,b_max,after",
    [
        ("b_max_tokens_1", A_PROMPT[:5] + [301, 302, 303], 1, False),
        ("b_max_tokens_8", A_PROMPT[:5] + [301, 302, 303], 8, False),
        ("b_shares_a_long_prefix", A_PROMPT[:150] + [301, 302], 4, False),
        ("b_shares_nothing", [301, 302, 303, 304, 305, 306, 307, 308], 4, False),
        ("b_after_a", A_PROMPT[:5] + [301, 302, 303], 4, True),
    ],
)
def test_seed_ablation_rows_over_http(server: ServeProcess, name: str, b_prompt: list[int], b_max: int, after: bool) -> None:
    overlap(server, b_prompt, b_max, b_after_a=after)
    with server.http() as c:
        assert c.get("/health").status_code == 200
    assert_balanced_idle(server.wait_idle())


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
    assert_balanced_idle(server.wait_idle())


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
    assert_balanced_idle(server.wait_idle())
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
    assert_balanced_idle(server.wait_idle())
