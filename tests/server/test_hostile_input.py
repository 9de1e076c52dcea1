"""Hostile request bodies over real HTTP: each is refused with a 4xx in the route's dialect, and
`/health` answers meanwhile.

Cases (issue 25, item 7): a body past `--max-request-bytes` (by Content-Length, and chunked with
no length), JSON nested far deeper than the limit (at the top, inside message content, and as a
2,000-level `json_schema`), a lone UTF-16 surrogate in a message, and `json_schema`s the grammar
compiler cannot use (`$ref` cycles: at the root, behind a required property, in a forced tool's
parameters, in Anthropic's `output_format`). "Meanwhile" is by control, not by timing: `/health` is
requested while the hostile body is still being uploaded (from inside the body's generator) or
right after its last byte was handed over, with the hostile request still unanswered. No duration
is asserted; the timeouts are hang guards.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from serving import ServeProcess

from freetoken.server.request_body import MAX_JSON_DEPTH
from freetoken.server.settings import DEFAULT_MAX_REQUEST_BYTES

MODEL = "tiny-gemma"
MiB = 1024 * 1024
JSON = {"content-type": "application/json"}


def health_ok(server: ServeProcess) -> None:
    r = httpx.get(f"{server.base}/health", timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["status"] == "ok"


def post_with_health(server: ServeProcess, path: str, parts: list[bytes]) -> httpx.Response:
    """POST `parts` as one chunked body; `/health` is asked (and must answer 200) after the
    first part was sent, while the rest is still to come, and again once the whole body was
    handed over, before the hostile request's answer is read."""
    sent = threading.Event()
    result: dict[str, Any] = {}

    def body() -> Iterator[bytes]:
        for i, part in enumerate(parts):
            yield part
            if i == 0 and len(parts) > 1:
                health_ok(server)  # mid-upload: the request is in the server's hands
        sent.set()

    def send() -> None:
        try:
            result["response"] = httpx.post(
                f"{server.base}{path}", content=body(), headers={**server.headers, **JSON}, timeout=120
            )
        except httpx.HTTPError as err:  # pragma: no cover - reported below
            result["error"] = err
        finally:
            sent.set()

    thread = threading.Thread(target=send)
    thread.start()
    assert sent.wait(120)
    health_ok(server)
    thread.join(120)
    assert not thread.is_alive(), "the hostile request got no answer"
    assert "error" not in result, result
    return result["response"]


def assert_openai_error(r: httpx.Response, status: int, code: str, param: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == code and error["type"] == "invalid_request_error"
    assert error["param"] == param
    return error


def assert_anthropic_error(r: httpx.Response, status: int, kind: str) -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == kind
    return str(body["error"]["message"])


def chat(content: Any = "hi", **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 2, **extra}


def nested(depth: int, inner: str = "") -> str:
    return "[" * depth + inner + "]" * depth


# -- size ---------------------------------------------------------------------------------------


def test_body_past_the_limit_by_content_length(server: ServeProcess) -> None:
    """64 MiB with a Content-Length: 413 before the body is read; /health answers meanwhile."""
    big = b'{"model": "tiny-gemma", "prompt": "' + b"a" * (64 * MiB) + b'"}'
    result: dict[str, httpx.Response] = {}
    thread = threading.Thread(
        target=lambda: result.update(r=httpx.post(f"{server.base}/v1/completions", content=big,
                                                  headers={**server.headers, **JSON}, timeout=120))
    )
    thread.start()
    health_ok(server)
    thread.join(120)
    error = assert_openai_error(result["r"], 413, "request_too_large")
    assert str(DEFAULT_MAX_REQUEST_BYTES) in error["message"] and "--max-request-bytes" in error["message"]
    health_ok(server)


def test_chunked_body_past_the_limit_is_counted(server: ServeProcess) -> None:
    """No Content-Length (chunked): counted as it streams in, 413 once past the limit."""
    head = b'{"model": "tiny-gemma", "prompt": "'
    parts = [head] + [b"a" * MiB] * (DEFAULT_MAX_REQUEST_BYTES // MiB + 2) + [b'"}']
    r = post_with_health(server, "/v1/completions", parts)
    assert_openai_error(r, 413, "request_too_large")


def test_body_past_the_limit_on_messages_is_anthropic_shaped(server: ServeProcess) -> None:
    head = b'{"model": "tiny-gemma", "max_tokens": 2, "messages": [{"role": "user", "content": "'
    r = post_with_health(server, "/v1/messages", [head] + [b"a" * MiB] * (DEFAULT_MAX_REQUEST_BYTES // MiB + 1) + [b'"}]}'])
    assert "--max-request-bytes" in assert_anthropic_error(r, 413, "request_too_large")
    big = head + b"a" * (DEFAULT_MAX_REQUEST_BYTES + 1) + b'"}]}'
    r = httpx.post(f"{server.base}/v1/messages", content=big, headers={**server.headers, **JSON}, timeout=120)
    assert_anthropic_error(r, 413, "request_too_large")


def test_body_exactly_at_the_limit_is_read(server: ServeProcess) -> None:
    """The limit is inclusive: a body of exactly --max-request-bytes (JSON whitespace padding) is
    parsed and judged on its content (here: an unknown model, 404)."""
    doc = b'{"model": "no-such-model", "prompt": "hi"}'
    body = doc + b" " * (DEFAULT_MAX_REQUEST_BYTES - len(doc))
    assert len(body) == DEFAULT_MAX_REQUEST_BYTES
    r = httpx.post(f"{server.base}/v1/completions", content=body, headers={**server.headers, **JSON}, timeout=120)
    assert_openai_error(r, 404, "model_not_found", "model")


# -- nesting ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", '{"model": "tiny-gemma", "messages": ' + nested(100_000) + "}"),  # 100,000 deep
        ("/v1/chat/completions", json.dumps(chat()).replace('"hi"', nested(20_000))),  # content 20,000 deep
        ("/v1/completions", nested(100_000)),  # not even an object
    ],
    ids=["array-100k", "content-20k", "bare-array"],
)
def test_deep_nesting_is_a_400_naming_the_limit(server: ServeProcess, path: str, body: str) -> None:
    r = post_with_health(server, path, [body.encode()])
    error = assert_openai_error(r, 400, "json_too_deep")
    assert str(MAX_JSON_DEPTH) in error["message"]


def test_deep_json_schema_is_a_400(server: ServeProcess) -> None:
    """A `json_schema` 2,000 levels deep (~4,000 JSON levels): refused before any decoder recurses."""
    schema = '{"type": "object", "properties": {"a": ' * 2000 + '{"type": "string"}' + "}}" * 2000
    body = json.dumps(chat(response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": {}}}))
    body = body.replace('"schema": {}', f'"schema": {schema}')
    error = assert_openai_error(post_with_health(server, "/v1/chat/completions", [body.encode()]), 400, "json_too_deep")
    assert str(MAX_JSON_DEPTH) in error["message"]


def test_nesting_at_the_limit_passes_the_scan(server: ServeProcess) -> None:
    """Exactly MAX_JSON_DEPTH levels (the body object counts as one), brackets inside strings not
    counted: the request is judged on its content (content of the wrong shape: a 400 naming the
    field); one level more is refused by the scan."""
    inner = nested(MAX_JSON_DEPTH - 3, '"[[[[{{{{"')  # body > messages > message = 3 levels
    r = httpx.post(f"{server.base}/v1/chat/completions", content=json.dumps(chat()).replace('"hi"', inner),
                   headers={**server.headers, **JSON}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] != "json_too_deep" and str(error["param"]).startswith("messages[0]"), error
    r = httpx.post(f"{server.base}/v1/chat/completions", content=json.dumps(chat()).replace('"hi"', nested(MAX_JSON_DEPTH - 2)),
                   headers={**server.headers, **JSON}, timeout=60)
    assert_openai_error(r, 400, "json_too_deep")


def test_deep_nesting_on_messages_is_anthropic_shaped(server: ServeProcess) -> None:
    body = '{"model": "tiny-gemma", "max_tokens": 2, "messages": ' + nested(100_000) + "}"
    message = assert_anthropic_error(post_with_health(server, "/v1/messages", [body.encode()]), 400, "invalid_request_error")
    assert str(MAX_JSON_DEPTH) in message


# -- unicode ------------------------------------------------------------------------------------


def test_lone_surrogate_is_a_400_naming_the_field(server: ServeProcess) -> None:
    body = json.dumps(chat("ok")).replace('"ok"', '"a\\ud800b"')
    error = assert_openai_error(post_with_health(server, "/v1/chat/completions", [body.encode()]), 400, "invalid_unicode",
                                "messages[0].content")
    assert "surrogate" in error["message"]
    body = '{"model": "tiny-gemma", "prompt": ["fine", "\\udfff"], "max_tokens": 2}'
    assert_openai_error(post_with_health(server, "/v1/completions", [body.encode()]), 400, "invalid_unicode", "prompt[1]")
    body = '{"model": "tiny-gemma", "max_tokens": 2, "messages": [{"role": "user", "content": "x\\ud83d"}]}'
    message = assert_anthropic_error(post_with_health(server, "/v1/messages", [body.encode()]), 400, "invalid_request_error")
    assert "messages[0].content" in message


def test_surrogate_pairs_are_text(server: ServeProcess) -> None:
    """An escaped pair (an emoji, as json.dumps writes it) is ordinary text: the request is served."""
    body = json.dumps(chat("smile \U0001F600"))
    assert "\\ud83d\\ude00" in body
    r = httpx.post(f"{server.base}/v1/chat/completions", content=body, headers={**server.headers, **JSON}, timeout=60)
    assert r.status_code == 200, r.text
    server.assert_balanced_idle()


# -- schemas the grammar compiler cannot use ------------------------------------------------------

CYCLE = {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}}
REQUIRED_CYCLE = {"type": "object", "properties": {"x": {"$ref": "#/$defs/a"}}, "required": ["x"], "$defs": {"a": {"$ref": "#/$defs/a"}}}


def schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}


@pytest.mark.parametrize("schema", [CYCLE, REQUIRED_CYCLE], ids=["root-cycle", "required-property-cycle"])
def test_ref_cycle_is_a_400_at_validation(server: ServeProcess, schema: dict[str, Any]) -> None:
    body = json.dumps(chat(response_format=schema_format(schema)))
    error = assert_openai_error(post_with_health(server, "/v1/chat/completions", [body.encode()]), 400, "invalid_grammar",
                                "response_format")
    assert "$ref" in error["message"]
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2, "response_format": schema_format(schema)})
    assert_openai_error(post_with_health(server, "/v1/completions", [body.encode()]), 400, "invalid_grammar", "response_format")
    server.assert_balanced_idle()  # nothing reached the engine, nothing leaked


def test_schema_the_compiler_refuses_is_a_400(server: ServeProcess) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a", "b"], "additionalProperties": False}
    body = json.dumps(chat(response_format=schema_format(schema)))
    r = httpx.post(f"{server.base}/v1/chat/completions", content=body, headers={**server.headers, **JSON}, timeout=60)
    assert_openai_error(r, 400, "invalid_grammar", "response_format")


def test_recursive_schema_with_an_exit_is_served(server: ServeProcess) -> None:
    """A recursive schema that admits finite values (a linked list ending in null) is not refused."""
    schema = {"type": "object", "properties": {"next": {"anyOf": [{"type": "null"}, {"$ref": "#"}]}}, "required": ["next"]}
    body = json.dumps(chat(response_format=schema_format(schema)))
    r = httpx.post(f"{server.base}/v1/chat/completions", content=body, headers={**server.headers, **JSON}, timeout=120)
    assert r.status_code == 200, r.text
    server.assert_balanced_idle()


def test_forced_tool_with_a_ref_cycle_is_a_400(server: ServeProcess) -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": REQUIRED_CYCLE}}
    body = json.dumps(chat(tools=[{"type": "function", "function": {"name": "g"}}, tool], tool_choice="required"))
    r = httpx.post(f"{server.base}/v1/chat/completions", content=body, headers={**server.headers, **JSON}, timeout=60)
    assert_openai_error(r, 400, "invalid_grammar", "tools[1].function.parameters")


def test_anthropic_output_format_with_a_ref_cycle_is_a_400(server: ServeProcess) -> None:
    body = json.dumps({"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}],
                       "output_format": {"type": "json_schema", "schema": CYCLE}})
    message = assert_anthropic_error(post_with_health(server, "/v1/messages", [body.encode()]), 400, "invalid_request_error")
    assert "$ref" in message and "output_format" in message


def test_the_server_still_serves(server: ServeProcess) -> None:
    """After every hostile request above: an ordinary request is served and the KV cache balances."""
    with server.http() as c:
        r = c.post("/v1/chat/completions", json=chat())
        assert r.status_code == 200, r.text
    server.assert_balanced_idle()

