"""`ft chat`'s REPL (freetoken/chat_cli.py) driven without a terminal or a server: scripted input
lines, an in-memory output, and a fake transport that records each request body and yields
scripted stream chunks (the shapes `/v1/chat/completions` streams: content, `reasoning_content`,
tool-call deltas, finish reasons); and the real HTTP transport against a small SSE server on
127.0.0.1 (a stream cut off, an HTTP error). The end-to-end run against a real `ft serve` is
tests/server/test_chat_cli_e2e.py."""

from __future__ import annotations

import http.server
import io
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from freetoken.chat_cli import DIM, RESET, ChatHTTPError, ChatREPL, HTTPTransport


def chunk(choice_delta: dict[str, Any] | None = None, finish: str | None = None) -> dict[str, Any]:
    return {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": choice_delta or {}, "finish_reason": finish}]}


class FakeTransport:
    """Each call pops the next script: a list of chunks, where an exception instance is raised
    at that point of the stream instead of yielded."""

    def __init__(self, *scripts: list[Any]) -> None:
        self.scripts = list(scripts)
        self.bodies: list[dict[str, Any]] = []
        self.closed = 0

    def __call__(self, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        self.bodies.append(json.loads(json.dumps(body)))  # a copy, as sent
        script = self.scripts.pop(0)

        def stream() -> Iterator[dict[str, Any]]:
            try:
                for item in script:
                    if isinstance(item, BaseException):
                        raise item
                    yield item
            finally:
                self.closed += 1

        return stream()


def answer(*pieces: str, finish: str = "stop") -> list[Any]:
    return [chunk({"role": "assistant"}), *(chunk({"content": p}) for p in pieces), chunk(finish=finish)]


def repl(transport: FakeTransport, lines: list[str], **kw: Any) -> tuple[ChatREPL, io.StringIO]:
    feed = iter(lines)

    def input_fn(prompt: str) -> str:
        try:
            line = next(feed)
        except StopIteration:
            raise EOFError from None
        if isinstance(line, BaseException):
            raise line
        return line

    out = io.StringIO()
    return ChatREPL(transport, model="m", input_fn=input_fn, out=out, **kw), out


def test_a_turn_streams_content_and_keeps_the_conversation() -> None:
    t = FakeTransport(answer("Hel", "lo!"), answer("Fine."))
    r, out = repl(t, ["hi", "how are you?"])
    r.run()
    assert "Hello!\n" in out.getvalue() and "Fine.\n" in out.getvalue()
    assert t.bodies[0] == {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    assert t.bodies[1]["messages"] == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "how are you?"},
    ]
    assert t.closed == 2


def test_multi_line_input_backslash_and_triple_quotes() -> None:
    t = FakeTransport(answer("a"), answer("b"), answer("c"))
    r, _ = repl(t, ["first \\", "second", '"""', "x = 1", "", "y = 2", '"""', '"""one line"""'])
    r.run()
    sent = [b["messages"][-1]["content"] for b in t.bodies]
    assert sent == ["first \nsecond", "x = 1\n\ny = 2", "one line"]


def test_reasoning_is_dimmed_on_a_terminal_and_marked_elsewhere() -> None:
    script = [chunk({"reasoning_content": "think "}), chunk({"reasoning_content": "more"}), chunk({"content": "42"}), chunk(finish="stop")]
    r, out = repl(FakeTransport(list(script)), ["q"], color=True)
    r.run()
    assert f"{DIM}think more{RESET}\n42\n" in out.getvalue()
    assert r.messages[-1] == {"role": "assistant", "content": "42", "reasoning_content": "think more"}
    r, out = repl(FakeTransport(list(script)), ["q"], color=False)
    r.run()
    assert "[reasoning] think more\n42\n" in out.getvalue() and "\x1b" not in out.getvalue()


def test_tool_calls_are_assembled_from_deltas_shown_and_kept() -> None:
    script = [
        chunk({"role": "assistant"}),
        chunk({"tool_calls": [{"index": 0, "id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"ci'}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": 'ty": "Paris"}'}}]}),
        chunk(finish="tool_calls"),
    ]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    t = FakeTransport(script)
    r, out = repl(t, ["weather?"], tools=tools, color=False)
    r.run()
    assert t.bodies[0]["tools"] == tools
    assert '[tool call call_1] get_weather({"city": "Paris"})' in out.getvalue()
    assert r.messages[-1] == {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}],
    }


def test_ctrl_c_during_the_stream_cancels_the_turn_and_the_repl_goes_on() -> None:
    # KeyboardInterrupt raised while the stream is being read: the stream is closed (the real
    # transport closes its connection, so the server aborts the request), the partial answer was
    # shown but neither it nor the user message is kept, and the next message is sent as if the
    # cancelled turn never happened.
    t = FakeTransport([chunk({"content": "partial "}), KeyboardInterrupt()], answer("ok"))
    r, out = repl(t, ["long question", "short one"], color=False)
    r.run()
    assert "partial \n[cancelled: this turn is not kept]\n" in out.getvalue()
    assert t.closed == 2
    assert t.bodies[1]["messages"] == [{"role": "user", "content": "short one"}]
    assert r.messages == [{"role": "user", "content": "short one"}, {"role": "assistant", "content": "ok"}]


def test_ctrl_c_while_printing_closes_the_stream_too() -> None:
    class Interrupting(io.StringIO):
        armed = True

        def write(self, s: str) -> int:
            if "boom" in s and self.armed:
                self.armed = False
                raise KeyboardInterrupt
            return super().write(s)

    t = FakeTransport(answer("boom", "never"), answer("ok"))
    feed = iter(["a", "b"])

    def input_fn(prompt: str) -> str:
        try:
            return next(feed)
        except StopIteration:
            raise EOFError from None

    r = ChatREPL(t, model="m", input_fn=input_fn, out=Interrupting(), color=False)
    r.run()
    assert t.closed == 2  # the first stream was closed although the interrupt came from outside it
    assert r.messages == [{"role": "user", "content": "b"}, {"role": "assistant", "content": "ok"}]


def test_ctrl_c_at_the_prompt_drops_the_line_and_ctrl_d_quits() -> None:
    t = FakeTransport(answer("ok"))
    r, _ = repl(t, [KeyboardInterrupt(), "after"])  # type: ignore[list-item]
    r.run()
    assert [b["messages"][-1]["content"] for b in t.bodies] == ["after"]


def test_server_errors_drop_the_turn() -> None:
    t = FakeTransport([chunk({"content": "x"}), ChatHTTPError("the engine died")], answer("ok"))
    r, out = repl(t, ["a", "b"], color=False)
    r.run()
    assert "[error: the engine died]" in out.getvalue()
    assert [m["content"] for m in r.messages] == ["b", "ok"]


def test_length_finish_is_noted() -> None:
    r, out = repl(FakeTransport(answer("abc", finish="length")), ["a"], color=False)
    r.run()
    assert "abc\n[stopped at max_tokens]\n" in out.getvalue()


def test_reset_system_save_and_exit(tmp_path: Path) -> None:
    saved = tmp_path / "chat.json"
    t = FakeTransport(answer("one"), answer("two"), answer("three"), answer("four"))
    lines = ["first", "/system Be brief.", "second", f"/save {saved}", "/reset", "third", "/bogus", "//slash", "/exit", "never read"]
    r, out = repl(t, lines, params={"max_tokens": 8}, color=False)
    r.run()
    assert t.bodies[1]["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "one"},
        {"role": "user", "content": "second"},
    ]
    assert t.bodies[1]["max_tokens"] == 8
    assert json.loads(saved.read_text()) == {"model": "m", "messages": [*t.bodies[1]["messages"], {"role": "assistant", "content": "two"}]}
    # /reset forgets the turns, keeps the system prompt
    assert t.bodies[2]["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "third"}]
    assert "[unknown command /bogus" in out.getvalue()
    assert t.bodies[3]["messages"][-1] == {"role": "user", "content": "/slash"}
    assert len(t.bodies) == 4  # /exit: "never read" was not


def test_double_slash_sends_a_message_starting_with_a_slash() -> None:
    t = FakeTransport(answer("ok"))
    r, _ = repl(t, ["//etc/passwd is a file", "/system", "/exit"])
    r.run()
    assert t.bodies[0]["messages"] == [{"role": "user", "content": "/etc/passwd is a file"}]
    assert r.system is None


def test_save_without_a_file_says_how() -> None:
    r, out = repl(FakeTransport(), ["/save"], color=False)
    r.run()
    assert "[usage: /save FILE]" in out.getvalue()


class _Handler(http.server.BaseHTTPRequestHandler):
    """Answers /v1/chat/completions by the request's first user message: `ok` streams two events
    and [DONE], `cut` sends one event and closes the connection, `401` is an HTTP error."""

    seen: list[dict[str, Any]] = []

    def log_message(self, *args: Any) -> None:
        pass

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).seen.append({"auth": self.headers.get("Authorization"), "body": body})
        what = body["messages"][-1]["content"]
        if what == "401":
            payload = json.dumps({"error": {"message": "bad key", "type": "authentication_error"}}).encode()
            self.send_response(401)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        self.wfile.write(f"data: {json.dumps(chunk({'content': 'Hi'}))}\n\n".encode())
        if what == "ok":
            self.wfile.write(f"data: {json.dumps(chunk({'content': ' there'}, 'stop'))}\n\ndata: [DONE]\n\n".encode())
        self.wfile.flush()
        self.close_connection = True


@pytest.fixture
def sse_server() -> Iterator[str]:
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    _Handler.seen = []
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()
        thread.join()


def test_http_transport_reads_events_and_reports_errors_as_turn_errors(sse_server: str) -> None:
    transport = HTTPTransport(sse_server, api_key="k", timeout_s=30)
    r, out = repl(transport, ["ok", "cut", "401", "ok"], color=False)  # type: ignore[arg-type]
    r.run()
    text = out.getvalue()
    assert text.startswith("Hi there\n")
    assert "[error: the stream ended without [DONE]]" in text
    assert "[error: 401: bad key]" in text
    assert [m["content"] for m in r.messages] == ["ok", "Hi there", "ok", "Hi there"]  # failed turns not kept
    assert all(s["auth"] == "Bearer k" for s in _Handler.seen)
    assert _Handler.seen[0]["body"]["stream"] is True


def test_the_greeting_warns_that_a_bundled_base_model_does_not_chat() -> None:
    from freetoken.chat_cli import greeting

    base = greeting("gemma3-270m", "http://127.0.0.1:1919")
    assert base.splitlines()[0] == (
        "ft chat: note: gemma3-270m is a base model: it continues text rather than answering; to chat, use "
        "smollm2-135m-instruct (`ft serve smollm2-135m-instruct`, or `ft chat --model smollm2-135m-instruct`)"
    )
    assert base.splitlines()[1].startswith("ft chat: gemma3-270m at http://127.0.0.1:1919;")
    chat = greeting("smollm2-135m-instruct", "http://h:1")
    assert chat == "ft chat: smollm2-135m-instruct at http://h:1; /help for commands, /exit or Ctrl-D to quit\n"
