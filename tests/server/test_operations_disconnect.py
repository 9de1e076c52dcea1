"""A client that disconnects from a non-streaming generation -- on the completions, chat,
Anthropic messages and Responses routes -- gets its request aborted in the engine: the request is counted as
499, it generated no more tokens than the engine's test hold let it (`--test-hold`,
tests/server/hold.py: one token before the hang-up; a stream gets one more after it, the write at
which a hang-up may be noticed), and its pages are free again (read from /v1/cache/status). So the
request is certainly in flight at the hang-up and certainly aborted rather than finished, on a
fast machine or a slow one. The client is a raw socket, so the hang-up comes exactly when the test
says. Deadlines are generous hang guards, nothing is timed."""

from __future__ import annotations

import json
import socket
import time
from typing import Any

import pytest
from hold import EngineHold
from serving import ServeProcess

GUARD_S = 60.0
MAX_TOKENS = 900
ROUTES: dict[str, tuple[str, dict[str, Any]]] = {
    "completions": ("/v1/completions", {"prompt": [5, 6, 7, 8], "ignore_eos": True, "max_tokens": MAX_TOKENS}),
    "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "ignore_eos": True, "max_tokens": MAX_TOKENS}),
    "messages": ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": MAX_TOKENS}),
    "responses": ("/v1/responses", {"input": "hi", "max_output_tokens": MAX_TOKENS}),
}


def metric_total(server: ServeProcess, endpoint: str, status: int) -> float:
    with server.http() as c:
        text = c.get("/metrics").text
    prefix = f'freetoken_requests_total{{endpoint="{endpoint}",status="{status}"}} '
    return sum(float(line[len(prefix):]) for line in text.splitlines() if line.startswith(prefix))


def send_raw(server: ServeProcess, path: str, body: dict[str, Any]) -> socket.socket:
    payload = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {server.api_key}\r\nContent-Length: {len(payload)}\r\n\r\n"
    ).encode()
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=GUARD_S)
    sock.sendall(head + payload)
    return sock


def poll_status(server: ServeProcess, ok: Any) -> dict[str, Any]:
    end = time.monotonic() + GUARD_S
    status = server.cache_status()
    while not ok(status) and time.monotonic() < end:
        time.sleep(0.02)
        status = server.cache_status()
    return status


def running_one(status: dict[str, Any]) -> bool:
    return status["engine"]["in_flight"] == 1 and status["engine"]["tokens_generated"] > 0 and any(
        p["in_use"] > 0 for p in status["pools"].values()
    )


def all_free(status: dict[str, Any]) -> bool:
    return status["engine"]["in_flight"] == 0 and all(p["in_use"] == 0 for p in status["pools"].values())


@pytest.mark.parametrize("endpoint", sorted(ROUTES))
def test_non_streaming_disconnect_aborts_and_frees_pages(server: ServeProcess, hold: EngineHold, endpoint: str) -> None:
    path, fields = ROUTES[endpoint]
    before_499 = metric_total(server, endpoint, 499)
    start = server.cache_status()["engine"]["tokens_generated"]
    hold.decode_after(1)
    sock = send_raw(server, path, {"model": "default", "temperature": 0, **fields})
    try:
        generating = poll_status(server, lambda s: running_one(s) and s["engine"]["tokens_generated"] > start)
        assert running_one(generating), generating
    finally:
        sock.close()  # the client goes away without reading a byte
    freed = poll_status(server, all_free)
    assert all_free(freed), freed
    assert freed["engine"]["tokens_generated"] - start == 1, freed["engine"]  # held at 1, then aborted
    end = time.monotonic() + GUARD_S
    while metric_total(server, endpoint, 499) == before_499 and time.monotonic() < end:
        time.sleep(0.05)
    assert metric_total(server, endpoint, 499) == before_499 + 1
    server.assert_balanced_idle()


@pytest.mark.parametrize("endpoint", sorted(ROUTES))
def test_streaming_disconnect_aborts_and_frees_pages(server: ServeProcess, hold: EngineHold, endpoint: str) -> None:
    """The same hang-up after the first bytes of a stream: noticed at the latest at the next
    write, which the hold then allows (one more token, and no more)."""
    path, fields = ROUTES[endpoint]
    before_499 = metric_total(server, endpoint, 499)
    start = server.cache_status()["engine"]["tokens_generated"]
    hold.decode_after(1)
    sock = send_raw(server, path, {"model": "default", "temperature": 0, "stream": True, **fields})
    try:
        assert b"data:" in sock.recv(65536) or b"data:" in sock.recv(65536)  # the stream has started
        generating = poll_status(server, lambda s: running_one(s) and s["engine"]["tokens_generated"] > start)
        assert running_one(generating), generating
    finally:
        sock.close()
    hold.decode_after(2)
    freed = poll_status(server, all_free)
    assert all_free(freed), freed
    assert 1 <= freed["engine"]["tokens_generated"] - start <= 2, freed["engine"]
    end = time.monotonic() + GUARD_S
    while metric_total(server, endpoint, 499) == before_499 and time.monotonic() < end:
        time.sleep(0.05)
    assert metric_total(server, endpoint, 499) == before_499 + 1
    server.assert_balanced_idle()
