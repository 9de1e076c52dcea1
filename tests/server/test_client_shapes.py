"""The request shapes today's SDKs and agent CLIs send, over real HTTP on the shared tiny-model
server: each is accepted (honoured, or ignored as docs/agents.md lists), values stay strictly
checked (each refusal names the key), `logit_bias` steers the sampler on both OpenAI routes,
streamed tool-call arguments arrive while they are written and join to the non-streamed ones, a
forced call cut off by max_tokens stays a call that ends with the length reason, and unknown
routes say that they do not exist. (Reasoning, CORS, unprefixed routes and a Claude-Code-shaped
first request: test_reasoning_routes.py, on a server started with those flags.)"""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import pytest
from serving import ServeProcess

MODEL = "tiny-gemma"
USER: Any = [{"role": "user", "content": "What is the weather in Paris?"}]
GREEDY = {"temperature": 0}
CITY = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]}}, "required": ["city"],
        "additionalProperties": False}
TOOLS: Any = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city", "parameters": CITY}}]
A_ID = 3 + ord("A")  # the tiny byte-level vocabulary: ids 3..258 are the bytes


def post(server: ServeProcess, path: str, body: dict[str, Any]) -> httpx.Response:
    with server.http() as c:
        return c.post(path, json=body, headers={"anthropic-version": "2023-06-01"})


def chat(server: ServeProcess, **fields: Any) -> dict[str, Any]:
    r = post(server, "/v1/chat/completions", {"model": MODEL, "max_tokens": 4, **GREEDY, **fields})
    assert r.status_code == 200, r.text
    return r.json()


def sse_data(r: httpx.Response) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]


# ---- OpenAI chat: shapes that must now be accepted ---------------------------------------------


def test_developer_role_renders_as_system(server: ServeProcess) -> None:
    as_system = chat(server, messages=[{"role": "system", "content": "Be terse."}, *USER])
    as_developer = chat(server, messages=[{"role": "developer", "content": "Be terse."}, *USER])
    assert as_developer["choices"][0]["message"]["content"] == as_system["choices"][0]["message"]["content"]
    assert as_developer["usage"]["prompt_tokens"] == as_system["usage"]["prompt_tokens"]


def test_resent_assistant_message_and_no_op_fields(server: ServeProcess) -> None:
    """`ChatCompletionMessage.model_dump()` re-sent, a refusal part, cache_control on a text part,
    and every no-op field current SDKs send; the prompt is the same as without them."""
    dumped = {"content": "Sunny.", "refusal": None, "role": "assistant", "annotations": None, "audio": None,
              "function_call": None, "tool_calls": None}
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "Weather?", "cache_control": {"type": "ephemeral"},
                                      "prompt_cache_breakpoint": {"mode": "explicit", "ttl": "12h"}}]},
        dumped,
        {"role": "assistant", "content": [{"type": "refusal", "refusal": "No."}]},
        {"role": "user", "content": "Again?"},
    ]
    plain = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "Sunny."},
             {"role": "assistant", "content": "No."}, {"role": "user", "content": "Again?"}]
    no_ops = {"store": False, "metadata": {"team": "a"}, "service_tier": "auto", "reasoning_effort": "low",
              "prompt_cache_key": "k1", "prompt_cache_retention": "24h", "prompt_cache_options": {"mode": "implicit", "ttl": "30m"},
              "safety_identifier": "u-1", "verbosity": "low", "user": "u"}
    out = chat(server, messages=messages, **no_ops)
    assert out["usage"]["prompt_tokens"] == chat(server, messages=plain)["usage"]["prompt_tokens"]
    r = post(server, "/v1/chat/completions", {"model": MODEL, "max_tokens": 2, "messages": messages, "stream": True,
                                                "stream_options": {"include_usage": True, "include_obfuscation": False}, **no_ops})
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]"), r.text
    assert all("obfuscation" not in chunk for chunk in sse_data(r))


def test_late_system_message_is_kept_in_place(server: ServeProcess) -> None:
    """ChatML renders a system message anywhere, so a mid-conversation one stays where it was sent."""
    messages = [*USER, {"role": "assistant", "content": "Let me see."}, {"role": "system", "content": "Reminder: be brief."},
                {"role": "user", "content": "Well?"}]
    with server.http() as c:
        text = c.post("/v1/tokenize", json={"messages": messages}).json()
    assert chat(server, messages=messages)["usage"]["prompt_tokens"] == text["count"]


def choice_text(r: httpx.Response) -> str:
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_logit_bias_steers_the_sampler(server: ServeProcess, path: str) -> None:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 4, "temperature": 1.0, "seed": 7}
    body |= {"messages": USER} if path.endswith("chat/completions") else {"prompt": "Hello"}
    b_id = A_ID + 1
    assert choice_text(post(server, path, {**body, "logit_bias": {str(A_ID): 100, str(b_id): 99}})) == "AAAA"
    assert choice_text(post(server, path, {**body, "logit_bias": {str(A_ID): -100, str(b_id): 99}})) == "BBBB"


# ---- values that must still be refused, each naming its key ------------------------------------

REFUSED = [
    ("/v1/chat/completions", {"messages": USER, "logit_bias": {"abc": 1}}, "logit_bias.abc"),
    ("/v1/chat/completions", {"messages": USER, "logit_bias": {"999999": 1}}, "logit_bias.999999"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias.5"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"5": "high"}}, "logit_bias.5"),
    ("/v1/chat/completions", {"messages": USER, "service_tier": "ultra"}, "service_tier"),
    ("/v1/chat/completions", {"messages": USER, "verbosity": 3}, "verbosity"),
    ("/v1/chat/completions", {"messages": USER, "metadata": {"a": 1}}, "metadata.a"),
    ("/v1/chat/completions", {"messages": USER, "store": "yes"}, "store"),
    ("/v1/chat/completions", {"messages": USER, "functions": [{"name": "f"}]}, "functions"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0]"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "colour": 1}]}]},
     "messages[0].content[0].colour"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "x",
                                                                         "cache_control": {"type": "forever"}}]}]},
     "messages[0].content[0].cache_control.type"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ("/v1/chat/completions", {"messages": USER, "stream": True, "stream_options": {"include_obfuscation": 1}},
     "stream_options.include_obfuscation"),
]


@pytest.mark.parametrize(("path", "body", "param"), REFUSED, ids=[p for _, _, p in REFUSED])
def test_wrong_values_are_400_naming_the_key(server: ServeProcess, path: str, body: dict[str, Any], param: str) -> None:
    r = post(server, path, {"model": MODEL, "max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
    assert param in r.json()["error"]["message"] or param.split(".")[0] in r.json()["error"]["message"]


# ---- tool calls while they are written ---------------------------------------------------------


def stream_tool_call(server: ServeProcess, body: dict[str, Any]) -> tuple[list[dict[str, Any]], str | None]:
    r = post(server, "/v1/chat/completions", {**body, "stream": True})
    assert r.status_code == 200, r.text
    deltas, finish = [], None
    for chunk in sse_data(r):
        for choice in chunk["choices"]:
            deltas += choice["delta"].get("tool_calls") or []
            assert not choice["delta"].get("content"), chunk  # a forced call is never text
            finish = choice["finish_reason"] or finish
    return deltas, finish


def test_streamed_arguments_are_incremental_and_join_to_the_whole(server: ServeProcess) -> None:
    body = {"model": MODEL, "messages": USER, "tools": TOOLS, "tool_choice": "required", "max_tokens": 60, **GREEDY}
    whole = chat(server, **body)["choices"][0]
    call = whole["message"]["tool_calls"][0]
    deltas, finish = stream_tool_call(server, body)
    assert finish == whole["finish_reason"] == "tool_calls"
    assert deltas[0]["id"] == deltas[0]["id"] and deltas[0]["function"]["name"] == "get_weather"
    fragments = [d["function"]["arguments"] for d in deltas]
    assert len([f for f in fragments if f]) > 2  # many pieces, not one at the end
    assert all("id" not in d and "name" not in d["function"] for d in deltas[1:])
    assert "".join(fragments) == call["function"]["arguments"]
    jsonschema.validate(json.loads(call["function"]["arguments"]), CITY)


def test_forced_call_cut_off_ends_with_length(server: ServeProcess) -> None:
    body = {"model": MODEL, "messages": USER, "tools": TOOLS, "tool_choice": "required", "max_tokens": 12, **GREEDY}
    choice = chat(server, **body)["choices"][0]
    assert choice["finish_reason"] == "length", choice
    assert choice["message"]["content"] is None and choice["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    deltas, finish = stream_tool_call(server, body)
    assert finish == "length" and deltas[0]["function"]["name"] == "get_weather"
    assert "".join(d["function"]["arguments"] for d in deltas) == choice["message"]["tool_calls"][0]["function"]["arguments"]
    r = post(server, "/v1/messages", {"model": MODEL, "max_tokens": 12, "messages": USER, "tool_choice": {"type": "any"},
                                      "tools": [{"name": "get_weather", "input_schema": CITY}], **GREEDY})
    assert r.status_code == 200, r.text
    assert r.json()["stop_reason"] == "max_tokens" and [b["type"] for b in r.json()["content"]] == ["tool_use"]


# ---- Anthropic Messages: shapes that must now be accepted --------------------------------------


def message(server: ServeProcess, **fields: Any) -> dict[str, Any]:
    r = post(server, "/v1/messages", {"model": MODEL, "max_tokens": 4, **GREEDY, **fields})
    assert r.status_code == 200, r.text
    return r.json()


def test_messages_accept_claude_code_and_sdk_fields(server: ServeProcess) -> None:
    history: Any = [
        {"role": "user", "content": [{"type": "text", "text": "Hi", "cache_control": {"type": "ephemeral"}}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "They greet me.", "signature": "sig=="},
            {"type": "redacted_thinking", "data": "opaque"},
            {"type": "text", "text": "Hello!", "citations": None},
        ]},
        {"role": "system", "content": "Reminder: the user is in Paris."},
        {"role": "user", "content": "Weather?"},
    ]
    out = message(
        server, messages=history, thinking={"type": "adaptive"}, context_management={"edits": [{"type": "clear_thinking_20251015"}]},
        output_config={"effort": "medium"}, thread={"type": "create"}, service_tier="auto", metadata={"user_id": "u"},
    )
    assert out["type"] == "message" and out["content"][0]["type"] == "text"  # no reasoning channel: no thinking block
    enabled = message(server, messages=history, thinking={"type": "enabled", "budget_tokens": 2048})
    assert enabled["content"] == out["content"]  # greedy: thinking is treated as disabled here


def test_messages_structured_output(server: ServeProcess) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}}, "required": ["city"],
              "additionalProperties": False}
    for fields in ({"output_config": {"format": {"type": "json_schema", "schema": schema}}},
                   {"output_format": {"type": "json_schema", "schema": schema}}):
        out = message(server, messages=USER, **{**fields, "max_tokens": 40})
        assert out["stop_reason"] == "end_turn", out
        jsonschema.validate(json.loads(out["content"][0]["text"]), schema)


ANTHROPIC_REFUSED = [
    ({"thread": {"type": "continue"}}, "thread.previous_message_id"),
    ({"thinking": {"type": "enabled", "budget_tokens": 10}}, "thinking.budget_tokens"),
    ({"thinking": {"type": "sometimes"}}, "thinking"),
    ({"output_config": {"effort": "extreme"}}, "output_config.effort"),
    ({"context_management": {"edits": "all"}}, "context_management.edits"),
    ({"messages": [{"role": "system", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]},
     "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "citations": "none"}]}]},
     "messages[0].content[0].citations"),
    ({"messages": [{"role": "user", "content": [{"type": "thinking", "thinking": "x", "signature": ""}]}]},
     "messages[0].content[0]"),
]


@pytest.mark.parametrize(("fields", "param"), ANTHROPIC_REFUSED, ids=[p for _, p in ANTHROPIC_REFUSED])
def test_messages_wrong_values_are_400_naming_the_key(server: ServeProcess, fields: dict[str, Any], param: str) -> None:
    r = post(server, "/v1/messages", {"model": MODEL, "max_tokens": 4, "messages": USER, **fields})
    assert r.status_code == 400, r.text
    doc = r.json()
    assert doc["type"] == "error" and doc["error"]["type"] == "invalid_request_error"
    assert param in doc["error"]["message"], doc


def test_thread_continue_with_an_unknown_id_is_404(server: ServeProcess) -> None:
    r = post(server, "/v1/messages", {"model": MODEL, "max_tokens": 2, "messages": USER,
                                      "thread": {"type": "continue", "previous_message_id": "msg_gone"}})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    assert "thread.previous_message_id" in r.json()["error"]["message"]


# ---- routes ------------------------------------------------------------------------------------


def test_unknown_routes_say_they_do_not_exist(server: ServeProcess) -> None:
    with server.http() as c:
        r = c.post("/v1/nonexistent", json={})
        assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}
        assert "does not exist" in r.json()["error"]["message"] and "/v1/nonexistent" in r.json()["error"]["message"]
        r = c.post("/v1/messages/nonexistent", json={})
        assert r.status_code == 404 and r.json()["type"] == "error" and r.json()["error"]["type"] == "not_found_error"
        assert "does not exist" in r.json()["error"]["message"]
        r = c.post("/chat/completions", json={})  # no unprefixed routes unless the flag asks
        assert r.status_code == 404
        r = c.get("/v1/chat/completions")
        assert r.status_code == 405 and "does not take GET" in r.json()["error"]["message"]


def test_idle_balanced_after_shape_traffic(server: ServeProcess) -> None:
    server.assert_balanced_idle()
