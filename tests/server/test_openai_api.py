"""The OpenAI surface over real HTTP: the official `openai` client, every bad input of issue 5
with its status and body, auth, models, health, cache status and metrics."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest
from conftest import API_KEY
from serving import ServeProcess

MODEL = "tiny-gemma"


@pytest.fixture(scope="module")
def oa(server: ServeProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def test_openai_completion(oa: openai.OpenAI) -> None:
    out = oa.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    assert out.model == MODEL and out.object == "text_completion"
    assert out.choices[0].finish_reason == "length"
    assert out.usage is not None and out.usage.completion_tokens == 5 and out.usage.prompt_tokens > 0
    again = oa.completions.create(model="default", prompt="The quick brown fox", max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    assert again.choices[0].text == out.choices[0].text  # greedy is deterministic


def test_openai_chat_and_stream_with_usage(oa: openai.OpenAI) -> None:
    messages: Any = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello, world!"}]
    out = oa.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    text = out.choices[0].message.content
    assert out.choices[0].message.role == "assistant" and out.choices[0].finish_reason == "length"
    stream = oa.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=6, temperature=0, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text
    assert chunks[-1].choices == [] and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]


def test_openai_completion_stream_n_and_logprobs(oa: openai.OpenAI) -> None:
    stream = oa.completions.create(model=MODEL, prompt=[5, 6, 7, 8], max_tokens=4, n=2, temperature=0, stream=True,
                                   logprobs=2, extra_body={"ignore_eos": True})
    texts = {0: "", 1: ""}
    tokens: dict[int, list[str]] = {0: [], 1: []}
    finished = set()
    for c in stream:
        for ch in c.choices:
            texts[ch.index] += ch.text
            if ch.finish_reason:
                finished.add(ch.index)
            if ch.text:  # text comes with the logprobs of its tokens (a held-back byte's come later, without text)
                assert ch.logprobs is not None and ch.logprobs.tokens, ch
            if ch.logprobs is not None:
                lp = ch.logprobs
                assert len(lp.token_logprobs) == len(lp.tokens) == len(lp.top_logprobs)
                assert all(1 <= len(t) <= 2 for t in lp.top_logprobs), lp
                assert all(x <= 0.0 for x in lp.token_logprobs)
                tokens[ch.index] += lp.tokens
    assert finished == {0, 1} and texts[0] == texts[1]  # greedy: both choices agree
    assert len(tokens[0]) == len(tokens[1]) == 4, tokens  # every generated token's logprobs were streamed


def test_openai_bad_request_raises(oa: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        oa.completions.create(model=MODEL, prompt="x", max_tokens=0)
    assert info.value.status_code == 400
    with pytest.raises(openai.NotFoundError):
        oa.completions.create(model="no-such-model", prompt="x", max_tokens=1)


def test_chat_stop_string_and_echo(server: ServeProcess) -> None:
    with server.http() as c:
        base = c.post("/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 12, "temperature": 0, "ignore_eos": True}).json()
        full = base["choices"][0]["text"]
        assert len(full.strip()) >= 5, f"12 greedy tokens of the tiny model gave {full!r}: no stop string to cut at"
        stop = full[3:5]
        cut = c.post("/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 12, "temperature": 0,
                                              "ignore_eos": True, "stop": [stop]}).json()
        assert cut["choices"][0]["finish_reason"] == "stop"
        assert cut["choices"][0]["text"] == full[: full.index(stop)]
        echoed = c.post("/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 3, "temperature": 0, "echo": True}).json()
        assert echoed["choices"][0]["text"].startswith("Hello")


BAD_INPUTS: list[tuple[str, str, Any, int, str | None, str | None]] = [
    # (name, path, body, status, param, code)
    ("malformed_json", "/v1/completions", b'{"model": "x", "prompt": ', 400, None, "invalid_json"),
    ("body_not_object", "/v1/completions", [1, 2, 3], 400, None, "invalid_json"),
    ("wrong_type", "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": "16"}, 400, "max_tokens", None),
    ("wrong_prompt_type", "/v1/completions", {"model": MODEL, "prompt": 5}, 400, "prompt", None),
    ("missing_prompt", "/v1/completions", {"model": MODEL}, 400, "prompt", "missing_required_parameter"),
    ("temperature_negative", "/v1/completions", {"model": MODEL, "prompt": "x", "temperature": -1}, 400, "temperature", None),
    ("top_p_zero", "/v1/completions", {"model": MODEL, "prompt": "x", "top_p": 0}, 400, "top_p", None),
    ("penalty_out_of_range", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                                      "presence_penalty": 3}, 400, "presence_penalty", None),
    ("max_tokens_zero", "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, "max_tokens", None),
    ("max_tokens_negative_chat", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                                          "max_tokens": -1}, 400, "max_tokens", None),
    ("past_context", "/v1/completions", {"model": MODEL, "prompt": [5] * 1000, "max_tokens": 100}, 400, "max_tokens",
     "context_length_exceeded"),
    ("prompt_alone_past_context", "/v1/completions", {"model": MODEL, "prompt": [5] * 1100, "max_tokens": 1}, 400, "prompt",
     "context_length_exceeded"),
    ("token_outside_vocab", "/v1/completions", {"model": MODEL, "prompt": [5, 999999]}, 400, "prompt", "invalid_token_id"),
    ("negative_token", "/v1/completions", {"model": MODEL, "prompt": [[5, -1]]}, 400, "prompt", "invalid_token_id"),
    ("empty_messages", "/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages", None),
    ("unknown_role", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, 400,
     "messages[0].role", None),
    ("n_too_large", "/v1/completions", {"model": MODEL, "prompt": "x", "n": 17}, 400, "n", None),
    ("unknown_model", "/v1/chat/completions", {"model": "gpt-5", "messages": [{"role": "user", "content": "x"}]}, 404, "model",
     "model_not_found"),
    ("unknown_field", "/v1/completions", {"model": MODEL, "prompt": "x", "frobnicate": 1}, 400, "frobnicate", None),
    ("functions_unimplemented", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                                         "functions": [{"name": "f"}]}, 400, "functions",
     "unsupported_parameter"),
    ("suffix_unimplemented", "/v1/completions", {"model": MODEL, "prompt": "x", "suffix": "y"}, 400, "suffix", None),
    ("stream_options_without_stream", "/v1/completions", {"model": MODEL, "prompt": "x", "stream_options": {"include_usage": True}},
     400, "stream_options", None),
    ("chat_past_context", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "a " * 1200}]}, 400,
     "messages", "context_length_exceeded"),
]


@pytest.mark.parametrize("name,path,body,status,param,code", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input(server: ServeProcess, name: str, path: str, body: Any, status: int, param: str | None, code: str | None) -> None:
    with server.http() as c:
        if isinstance(body, bytes):
            r = c.post(path, content=body, headers={"content-type": "application/json"})
        else:
            r = c.post(path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"]
    assert err["type"] == ("invalid_request_error" if status in (400, 404) else err["type"])
    assert err["param"] == param
    if code is not None:
        assert err["code"] == code


def test_api_key(server: ServeProcess) -> None:
    body = {"model": MODEL, "prompt": "x", "max_tokens": 1}
    r = httpx.post(f"{server.base}/v1/completions", json=body, timeout=60)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.post(f"{server.base}/v1/completions", json=body, headers={"Authorization": "Bearer wrong"}, timeout=60)
    assert r.status_code == 401
    r = httpx.post(f"{server.base}/v1/completions", json=body, headers={"x-api-key": API_KEY}, timeout=60)
    assert r.status_code == 200, r.text
    assert httpx.get(f"{server.base}/health", timeout=30).status_code == 200  # health needs no key


def test_models_health_unknown_route(server: ServeProcess) -> None:
    with server.http() as c:
        models = c.get("/v1/models").json()
        assert [m["id"] for m in models["data"]] == [MODEL] and models["object"] == "list"
        assert c.get(f"/v1/models/{MODEL}").status_code == 200
        assert c.get("/v1/models/nope").json()["error"]["code"] == "model_not_found"
        health = c.get("/health").json()
        assert health["status"] == "ok" and health["pid"] > 0 and health["model"] == MODEL
        r = c.get("/v1/nothing-here")
        assert r.status_code == 404 and "error" in r.json()


def test_cache_status_fields_and_metrics(server: ServeProcess) -> None:
    with server.http() as c:
        c.post("/v1/completions", json={"model": MODEL, "prompt": "metrics please", "max_tokens": 3})
        status = server.assert_balanced_idle()
        assert status["cache_type"] == "swa_radix" and status["page_size"] == 4
        assert set(status["pools"]) == {"full", "swa"}
        for pool in status["pools"].values():
            assert set(pool) >= {"capacity", "free", "cached", "in_use", "quarantined"}
        assert isinstance(status["floor"], int) and status["floor"] > 0
        assert set(status["integrity"]) >= {"ok", "audits", "violations", "quarantined_pages", "last_error"}
        text = c.get("/metrics").text
    for name in ("freetoken_requests_total", "freetoken_generation_tokens_total", "freetoken_time_to_first_token_seconds_bucket",
                 "freetoken_request_latency_seconds_bucket", "freetoken_kv_pool_pages", "freetoken_cache_hit_tokens_total",
                 "freetoken_kv_audit_violations", "freetoken_engine_restarts"):
        assert name in text, name
    assert 'freetoken_requests_total{endpoint="completions",status="200"}' in text
