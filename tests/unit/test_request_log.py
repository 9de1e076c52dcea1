"""The per-request log line (server/operations/request_log.py: its wording, and the middleware
that gives every request not on a quiet path one line) and the engine's periodic throughput line
(server/process/throughput.py), driven by a fake clock: nothing is timed."""

from __future__ import annotations

import logging

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from freetoken.server.operations.request_log import RequestEnd, RequestLines, log_refused, log_request, request_line
from freetoken.server.process.throughput import ThroughputLog, Totals


def test_a_request_line_has_route_tokens_ttft_speed_finish_and_id() -> None:
    end = RequestEnd("chat", 200, "req-1", 512, 480, 65, 0.1234, 2.0, ["stop"])
    assert end.line() == "chat 200 id=req-1 prompt=512 cached=480 generated=65 ttft=0.123s tok/s=32.0 finish=stop"
    fields = end.fields()
    assert fields["tokens_per_s"] == 32.0 and fields["ttft_s"] == 0.1234 and fields["finish_reason"] == "stop"
    assert fields["prompt_tokens"] == 512 and fields["cached_tokens"] == 480 and fields["request_id"] == "req-1"


def test_a_request_line_without_tokens_or_with_several_choices() -> None:
    none = RequestEnd("completions", 499, "r", 10, 0, 0, None, None, [None])
    assert none.line() == "completions 499 id=r prompt=10 cached=0 generated=0 ttft=- tok/s=- finish=none"
    one = RequestEnd("messages", 200, "r", 10, 0, 1, 0.5, 0.0, ["length"])
    assert one.tokens_per_s is None  # one token: no decode speed
    assert RequestEnd("chat", 200, "r", 1, 0, 4, 0.1, 1.0, ["stop", "length"]).finish == "stop,length"
    assert RequestEnd("chat", 200, "r", 1, 0, 4, 0.1, 1.0, ["stop", "stop"]).finish == "stop"


def test_log_request_and_log_refused_write_one_line_each(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="freetoken.requests"):
        log_request(RequestEnd("chat", 200, "a", 3, 0, 2, 0.01, 0.1, ["stop"]))
        log_refused("chat", 429, "b", "the engine's waiting queue is full")
    first, second = caplog.records
    assert first.getMessage().startswith("chat 200 id=a") and first.route == "chat"  # type: ignore[attr-defined]
    assert second.getMessage() == "chat 429 id=b error=\"the engine's waiting queue is full\""
    assert second.error == "the engine's waiting queue is full" and second.status == 429  # type: ignore[attr-defined]


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_throughput_line_every_period_while_busy_and_none_when_idle() -> None:
    clock, lines = FakeClock(), []
    tl = ThroughputLog(period_s=10.0, clock=clock, emit=lambda text, fields: lines.append((text, fields)))
    for _ in range(3):  # idle: no period opens
        clock.now += 20
        assert tl.observe(busy=False, running=0, waiting=0, totals=Totals()) is None
    # work: a period begins; the prompt that brought it (added before this turn) counts in it
    assert tl.observe(busy=True, running=1, waiting=0, totals=Totals(0, 100, 0)) is None
    clock.now += 9.9
    assert tl.observe(busy=True, running=2, waiting=1, totals=Totals(50, 300, 0, 120)) is None  # not yet
    clock.now += 0.1
    text = tl.observe(busy=True, running=2, waiting=1, totals=Totals(100, 300, 1, 250))
    assert text == (
        "busy: 2 running, 1 waiting; last 10 s: 100 tokens generated (10.0 tok/s), 250 prompt tokens prefilled "
        "(25.0 tok/s), 300 prompt tokens in, 1 requests finished"
    )
    assert lines[0][1]["generated_tokens_per_s"] == 10.0 and lines[0][1]["waiting"] == 1
    assert lines[0][1]["prefilled_tokens_per_s"] == 25.0
    clock.now += 5
    tl.observe(busy=False, running=0, waiting=0, totals=Totals(150, 300, 2, 250))  # went idle mid-period
    clock.now += 5
    text = tl.observe(busy=False, running=0, waiting=0, totals=Totals(150, 300, 2, 250))  # the period's tail is still told
    assert text is not None and "50 tokens generated (5.0 tok/s)" in text and "1 requests finished" in text
    assert "0 prompt tokens prefilled" in text
    for _ in range(5):  # idle again: quiet
        clock.now += 10
        assert tl.observe(busy=False, running=0, waiting=0, totals=Totals(150, 300, 2)) is None
    assert len(lines) == 2


def test_throughput_period_must_be_positive() -> None:
    with pytest.raises(ValueError, match="period must be positive"):
        ThroughputLog(period_s=0)


# -- the middleware: one line for every request whose route writes none -----------------------


def _scope(method: str, path: str, request_id: str) -> dict:
    return {"type": "http", "method": method, "path": path, "headers": [], "query_string": b"", "state": {"request_id": request_id}}


def _call(app, scope: dict) -> list[dict]:  # type: ignore[no-untyped-def]
    """Drive an ASGI app through one request (an empty body); the messages it sent."""
    import asyncio

    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict) -> None:
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    return sent


def _routes():  # type: ignore[no-untyped-def]
    """A small FastAPI app with RequestLines around it, and the routes of each kind."""
    app = FastAPI()

    @app.get("/v1/things/{thing_id}")
    async def thing(thing_id: str) -> dict:
        return {"id": thing_id}

    @app.post("/v1/count")
    async def count(request: Request) -> dict:
        line = request_line(request.scope)
        line.route, line.prompt_tokens = "count", 12
        return {"count": 12}

    @app.post("/v1/generate")
    async def generate(request: Request) -> dict:
        request_line(request.scope).written = True  # as the generation recipe does
        return {}

    @app.post("/v1/refused")
    async def refused() -> JSONResponse:
        return JSONResponse({"type": "error", "error": {"type": "x", "message": "no \"such\" thing"}}, status_code=400)

    @app.get("/health")
    async def health() -> dict:
        return {}

    @app.get("/v1/broken")
    async def broken() -> dict:
        raise RuntimeError("boom")

    return RequestLines(app, quiet=("/health",))


def test_every_request_not_quiet_gets_one_line_unless_its_route_wrote_it(caplog: pytest.LogCaptureFixture) -> None:
    app = _routes()
    with caplog.at_level(logging.INFO, logger="freetoken.requests"):
        _call(app, _scope("GET", "/v1/things/abc", "r1"))
        _call(app, _scope("POST", "/v1/count", "r2"))
        _call(app, _scope("POST", "/v1/generate", "r3"))
        _call(app, _scope("POST", "/v1/refused", "r4"))
        _call(app, _scope("GET", "/health", "r5"))
        _call(app, _scope("GET", "/nowhere/" + "x" * 300, "r6"))
        with pytest.raises(RuntimeError):
            _call(app, _scope("GET", "/v1/broken", "r7"))
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "GET /v1/things/{thing_id} 200 id=r1",  # the route's path, not the id in it
        "count 200 id=r2 prompt=12",  # the route named itself and counted
        "POST /v1/refused 400 id=r4 error='no \"such\" thing'",  # the message read from the error body
        "GET /nowhere/" + "x" * 191 + " 404 id=r6",  # unrouted: the path as sent, cut short
        "GET /v1/broken 500 id=r7",  # raised: nothing was answered yet
    ]  # r3 wrote its own line, r5 is quiet
    counted = caplog.records[1]
    assert counted.route == "count" and counted.prompt_tokens == 12 and counted.request_id == "r2"  # type: ignore[attr-defined]
    assert caplog.records[2].error == 'no "such" thing' and caplog.records[2].status == 400  # type: ignore[attr-defined]


def test_a_streamed_response_passes_through_untouched() -> None:
    chunks = [b"data: 1\n\n", b"data: 2\n\n", b""]

    async def stream(scope, receive, send) -> None:  # type: ignore[no-untyped-def]
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for i, body in enumerate(chunks):
            await send({"type": "http.response.body", "body": body, "more_body": i < len(chunks) - 1})

    sent = _call(RequestLines(stream, quiet=()), _scope("POST", "/v1/chat/completions", "r"))
    assert [m.get("body") for m in sent[1:]] == chunks and sent[0]["status"] == 200
