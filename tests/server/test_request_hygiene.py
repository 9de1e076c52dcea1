"""Request hygiene over real HTTP: `x-request-id` on every response (the client's when sane, else
generated) and `--request-timeout`, which ends a long request with an error -- a 504 before the
response started, an error event in a stream -- and releases its pages.

The timeout runs on its own small server. Nothing assumes how fast the engine decodes: the test
freezes the engine process (SIGSTOP) so that the request certainly outlives the deadline, and
resumes it (SIGCONT) once the error came back -- before the request for a 504, after the first
content event for a stream. What remains is one generous bound: a stream's first token must
arrive within TIMEOUT_S, and a 3-token request must finish within it."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import API_KEY, SHARED_FLAGS
from serving import ServeProcess, serving

from freetoken.server.request_hygiene import engine_rid, sane_request_id

MODEL = "tiny-gemma"
HELLO = [{"role": "user", "content": "Hello, world!"}]
LONG = 900  # decode steps: the engine is frozen long before a request this long could finish
TIMEOUT_S = 10  # --request-timeout of the `timed` server: a generous bound on the first tokens, not on decoding


def test_sane_ids_and_engine_rids() -> None:
    assert sane_request_id("abc-123_x.y:z") == "abc-123_x.y:z"
    for bad in (None, "", "has space", "x" * 129, "new\nline", "é"):
        assert sane_request_id(bad) is None
    rids = {engine_rid("client-id", f"msg_{i}", 0) for i in range(3)}
    assert len(rids) == 3 and all("client-id" in r for r in rids)


def test_request_id_echoed_everywhere(server: ServeProcess) -> None:
    with server.http() as c:
        calls = [
            c.get("/v1/models", headers={"x-request-id": "given-1"}),
            c.post("/v1/chat/completions", json={"model": MODEL, "messages": HELLO, "max_tokens": 2}, headers={"x-request-id": "given-2"}),
            c.post("/v1/messages", json={"model": MODEL, "messages": HELLO, "max_tokens": 2}, headers={"x-request-id": "given-3"}),
            c.post("/v1/tokenize", json={"prompt": 5}, headers={"x-request-id": "given-4"}),  # a 400
            c.get("/health", headers={"x-request-id": "given-5"}),
        ]
        assert [r.status_code for r in calls] == [200, 200, 200, 400, 200]
        assert [r.headers["x-request-id"] for r in calls] == [f"given-{i}" for i in range(1, 6)]
        assert calls[2].headers["request-id"] == "given-3"  # the header the anthropic client reads
        with c.stream("POST", "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2, "stream": True},
                      headers={"x-request-id": "given-6"}) as r:
            assert r.status_code == 200 and r.headers["x-request-id"] == "given-6"
            assert r.read().decode().endswith("data: [DONE]\n\n")
    denied = httpx.post(f"{server.base}/v1/messages", json={}, headers={"x-request-id": "given-7"}, timeout=30)
    assert denied.status_code == 401 and denied.headers["x-request-id"] == "given-7"
    assert denied.json()["request_id"] == "given-7" and denied.json()["error"]["type"] == "authentication_error"
    generated = {httpx.get(f"{server.base}/health", timeout=30).headers["x-request-id"] for _ in range(3)}
    assert len(generated) == 3 and all(re.fullmatch(r"req-[0-9a-f]{32}", g) for g in generated)
    weird = httpx.get(f"{server.base}/health", headers={"x-request-id": "a b"}, timeout=30).headers["x-request-id"]
    assert weird.startswith("req-")


def test_a_reused_request_id_does_not_collide(server: ServeProcess) -> None:
    """Two requests in flight with the same x-request-id are two engine requests."""
    results: list[int] = []

    def run() -> None:
        with server.http() as c:
            body = {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 40, "ignore_eos": True}
            results.append(c.post("/v1/completions", json=body, headers={"x-request-id": "same"}).status_code)

    threads = [threading.Thread(target=run) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [200, 200, 200]
    server.assert_balanced_idle()


@pytest.fixture(scope="module")
def timed(tiny_gemma_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    log = tmp_path_factory.mktemp("serve_logs") / "timeout.log"
    with serving(str(tiny_gemma_dir), [*SHARED_FLAGS, "--request-timeout", str(TIMEOUT_S)], log, api_key=API_KEY) as proc:
        yield proc


@contextmanager
def frozen_engine(server: ServeProcess) -> Iterator[None]:
    """The engine process stopped (SIGSTOP) for the block: no step runs, so no request in it can
    finish before its deadline. The supervisor watches only the process's exit, so it does not
    restart a stopped engine; SIGCONT in any case, so that the server shuts down cleanly."""
    pid = int(server.wait_healthy()["pid"])
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def test_timeout_non_stream_is_a_504_and_frees_pages(timed: ServeProcess) -> None:
    with timed.http() as c:
        ok = c.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 3})
        assert ok.status_code == 200, ok.text  # a short request is untouched
        with frozen_engine(timed):
            r = c.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": LONG, "ignore_eos": True})
            m = c.post("/v1/messages", json={"model": MODEL, "messages": HELLO, "max_tokens": LONG, "temperature": 0},
                       headers={"x-request-id": "slow-1"})
    assert r.status_code == 504, r.text
    assert r.json()["error"]["code"] == "request_timeout" and "--request-timeout" in r.json()["error"]["message"]
    assert m.status_code == 504 and m.json() == {
        "type": "error", "error": {"type": "timeout_error", "message": m.json()["error"]["message"]}, "request_id": "slow-1"
    }
    timed.assert_balanced_idle()


def read_until(lines: Iterator[str], seen: list[str], done: Callable[[list[str]], bool]) -> None:
    """Append the stream's non-empty lines to `seen` until `done(seen)` (or the stream ends)."""
    for line in lines:
        if line:
            seen.append(line)
            if done(seen):
                return


def test_timeout_mid_stream_is_an_error_event_and_frees_pages(timed: ServeProcess) -> None:
    body = {"model": MODEL, "messages": HELLO, "max_tokens": LONG, "ignore_eos": True, "stream": True}
    lines: list[str] = []
    with timed.http() as c, c.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        it = r.iter_lines()
        read_until(it, lines, lambda seen: sum('"content"' in x for x in seen) >= 2)  # content streamed
        streamed = len(lines)
        with frozen_engine(timed):
            read_until(it, lines, lambda seen: False)  # to the end: the deadline must close it
    assert streamed >= 2 and all("error" not in x for x in lines[:streamed]), lines
    assert "data: [DONE]" not in lines
    last = json.loads(lines[-1][6:])
    assert last["error"]["code"] == "request_timeout" and last["error"]["type"] == "timeout_error"
    timed.assert_balanced_idle()


def test_timeout_mid_anthropic_stream_is_an_error_event(timed: ServeProcess) -> None:
    body: dict[str, Any] = {"model": MODEL, "messages": HELLO, "max_tokens": LONG, "temperature": 0, "stream": True}
    lines: list[str] = []
    with timed.http() as c, c.stream("POST", "/v1/messages", json=body) as r:
        assert r.status_code == 200
        it = r.iter_lines()
        read_until(it, lines, lambda seen: seen[-1].startswith("data: ") and "content_block_delta" in seen[-1])
        with frozen_engine(timed):
            read_until(it, lines, lambda seen: False)
    names = [line[7:] for line in lines if line.startswith("event: ")]
    assert names[:4] == ["message_start", "content_block_start", "ping", "content_block_delta"]
    assert names[-1] == "error" and "message_stop" not in names and "message_delta" not in names
    assert json.loads(lines[-1][6:])["error"]["type"] == "timeout_error"
    timed.assert_balanced_idle()
