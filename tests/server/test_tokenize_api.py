"""`/v1/tokenize` and `/v1/detokenize` over real HTTP on the shared tiny-model server: round trips,
the chat rendering equal to what `/v1/chat/completions` runs, and a 400 naming the field for
every kind of bad input."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from serving import ServeProcess

MODEL = "tiny-gemma"
TEXT = 'The quick brown fox jumps over the lazy dog. {"city": "Paris"} print("hello world")'
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello, world!"}]


@pytest.fixture(scope="module")
def http(server: ServeProcess) -> Any:
    with server.http() as client:
        yield client


def tokenize(http: httpx.Client, body: dict[str, Any]) -> dict[str, Any]:
    r = http.post("/v1/tokenize", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_prompt_round_trip(http: httpx.Client, server: ServeProcess) -> None:
    out = tokenize(http, {"model": MODEL, "prompt": TEXT})
    assert out["count"] == len(out["tokens"]) > 10
    assert all(isinstance(t, int) for t in out["tokens"])
    assert out["max_model_len"] == server.wait_healthy()["context_length"]
    back = http.post("/v1/detokenize", json={"model": MODEL, "tokens": out["tokens"]})
    assert back.status_code == 200, back.text
    assert back.json() == {"prompt": TEXT}
    assert tokenize(http, {"prompt": TEXT, "add_special_tokens": False})["tokens"] == out["tokens"]  # this tokenizer adds no BOS
    assert http.post("/v1/detokenize", json={"tokens": []}).json() == {"prompt": ""}


def test_prompt_count_equals_the_completion_prompt(http: httpx.Client) -> None:
    out = tokenize(http, {"prompt": TEXT})
    done = http.post("/v1/completions", json={"model": MODEL, "prompt": TEXT, "max_tokens": 1})
    assert done.status_code == 200, done.text
    assert done.json()["usage"]["prompt_tokens"] == out["count"]


def test_messages_are_the_chat_prompt(http: httpx.Client) -> None:
    out = tokenize(http, {"model": MODEL, "messages": MESSAGES})
    done = http.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, "max_tokens": 1})
    assert done.status_code == 200, done.text
    assert done.json()["usage"]["prompt_tokens"] == out["count"]
    text = http.post("/v1/detokenize", json={"tokens": out["tokens"]}).json()["prompt"]
    assert text == "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHello, world!<|im_end|>\n<|im_start|>assistant\n"
    bare = tokenize(http, {"messages": MESSAGES, "add_generation_prompt": False})
    assert bare["count"] < out["count"] and out["tokens"][: bare["count"]] == bare["tokens"]


TOOLS = [{"type": "function", "function": {"name": "get_time", "description": "The time in a city.",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
TOOL_HISTORY = [
    {"role": "user", "content": "What time is it in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "12:00"},
]


def test_tool_conversations_count_what_the_chat_route_runs(http: httpx.Client) -> None:
    out = tokenize(http, {"messages": TOOL_HISTORY, "tools": TOOLS})
    done = http.post("/v1/chat/completions", json={"model": MODEL, "messages": TOOL_HISTORY, "tools": TOOLS, "max_tokens": 1})
    assert done.status_code == 200, done.text
    assert done.json()["usage"]["prompt_tokens"] == out["count"]
    without_tools = tokenize(http, {"messages": TOOL_HISTORY})
    assert without_tools["count"] < out["count"]  # the tool prompt is counted
    text = http.post("/v1/detokenize", json={"tokens": without_tools["tokens"]}).json()["prompt"]
    assert "get_time" in text and "12:00" in text  # the earlier call and its result are rendered


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/detokenize", {"tokens": [5, -1]}, "tokens[1]"),
        ("/v1/detokenize", {"tokens": [5, 10**6]}, "tokens[1]"),
        ("/v1/detokenize", {"tokens": ["a"]}, "tokens[0]"),
        ("/v1/detokenize", {"tokens": [1.5]}, "tokens[0]"),
        ("/v1/detokenize", {"tokens": "1 2"}, "tokens"),
        ("/v1/detokenize", {}, "tokens"),
        ("/v1/detokenize", {"tokens": [1], "extra": 1}, "extra"),
        ("/v1/tokenize", {"prompt": 5}, "prompt"),
        ("/v1/tokenize", {"prompt": ["a"]}, "prompt"),
        ("/v1/tokenize", {}, "prompt"),
        ("/v1/tokenize", {"prompt": "a", "messages": MESSAGES}, "messages"),
        ("/v1/tokenize", {"messages": []}, "messages"),
        ("/v1/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ("/v1/tokenize", {"prompt": "a", "add_generation_prompt": True}, "add_generation_prompt"),
        ("/v1/tokenize", {"messages": MESSAGES, "add_special_tokens": True}, "add_special_tokens"),
        ("/v1/tokenize", {"messages": MESSAGES, "add_generation_prompt": "yes"}, "add_generation_prompt"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(http: httpx.Client, path: str, body: dict[str, Any], param: str) -> None:
    r = http.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err


def test_unknown_model_and_missing_key(http: httpx.Client, server: ServeProcess) -> None:
    r = http.post("/v1/tokenize", json={"model": "no-such-model", "prompt": "x"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = httpx.post(f"{server.base}/v1/detokenize", json={"tokens": [1]}, timeout=30)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = http.post("/v1/tokenize", content=b"{not json")
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
