"""`ft serve` as a worker of sglang-router and vllm-router, on the shared tiny-model server: the
bodies the routers forward (captured from sglang-router 0.3.2 and vllm-router 0.1.17 in front of
a logging stub) are accepted, `no_stop_trim` is honoured, a router field at a value this server
does not implement is a 400 naming it, the probe routes answer in the shapes the routers parse,
and the render routes give the ids the inference routes prefill. No router runs here
(test_router_pool.py starts them)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from serving import ServeProcess

MODEL = "tiny-gemma"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello there"}]

# What each router sends for {"model", "messages"/"prompt", "max_tokens"}: its typed request
# re-serialized, defaults included (sglang-router also renames max_tokens to max_completion_tokens).
SGLANG_CHAT = {
    "messages": MESSAGES, "model": MODEL, "logprobs": False, "max_completion_tokens": 4, "stream": False,
    "no_stop_trim": False, "ignore_eos": False, "continue_final_message": False, "skip_special_tokens": True,
    "separate_reasoning": True, "stream_reasoning": True, "return_hidden_states": False,
}
VLLM_CHAT = {
    "model": MODEL, "messages": MESSAGES, "stream": False, "max_tokens": 4, "logprobs": False, "no_stop_trim": False,
    "ignore_eos": False, "continue_final_message": False, "skip_special_tokens": True, "separate_reasoning": True,
    "stream_reasoning": True, "return_hidden_states": False, "include_reasoning": True,
    "session_params": {"session_id": "conversation-1"},
}
ROUTER_COMPLETION = {
    "model": MODEL, "prompt": "hello there", "max_tokens": 4, "stream": False, "echo": False, "no_stop_trim": False,
    "ignore_eos": False, "skip_special_tokens": True, "return_hidden_states": False,
}


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/chat/completions", SGLANG_CHAT), ("/v1/chat/completions", VLLM_CHAT), ("/v1/completions", ROUTER_COMPLETION),
], ids=["sglang_chat", "vllm_chat", "completion"])
def test_forwarded_bodies_are_served(server: ServeProcess, path: str, body: dict[str, Any]) -> None:
    with server.http() as c:
        r = c.post(path, json=body)
    assert r.status_code == 200, r.text
    # The routers' defaults sample at temperature 1 without a seed, so the random-weight model
    # may end early on its end-of-turn token; the token budget is what must hold either way.
    used, finish = r.json()["usage"]["completion_tokens"], r.json()["choices"][0]["finish_reason"]
    assert (finish, used) == ("length", 4) or (finish == "stop" and 1 <= used <= 4), (finish, used)
    server.assert_balanced_idle()


def test_forwarded_responses_body_is_served(server: ServeProcess) -> None:
    """sglang-router's /v1/responses body for {"model", "input", "max_output_tokens"}."""
    body = {"input": "hello there", "max_output_tokens": 4, "model": MODEL, "store": True, "stream": None, "temperature": 1.0,
            "top_p": 1.0, "priority": 0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0}
    with server.http() as c:
        r = c.post("/v1/responses", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    if out["status"] == "incomplete":  # the budget ran out, as it does unless the model ends its turn first
        assert (out["incomplete_details"]["reason"], out["usage"]["output_tokens"]) == ("max_output_tokens", 4)
    else:
        assert out["status"] == "completed" and 1 <= out["usage"]["output_tokens"] <= 4, out
    server.assert_balanced_idle()


def test_no_stop_trim_keeps_the_stop_string(server: ServeProcess) -> None:
    base = {"model": MODEL, "prompt": "Hello", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    with server.http() as c:
        full = c.post("/v1/completions", json=base).json()["choices"][0]["text"]
        assert len(full.strip()) >= 5, f"12 greedy tokens of the tiny model gave {full!r}: no stop string to cut at"
        stop = full[3:5]
        cut = full.index(stop)
        trimmed = c.post("/v1/completions", json={**base, "stop": [stop], "no_stop_trim": False}).json()["choices"][0]
        kept = c.post("/v1/completions", json={**base, "stop": [stop], "no_stop_trim": True}).json()["choices"][0]
        chat = c.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, "max_tokens": 12, "temperature": 0,
                                                    "ignore_eos": True}).json()["choices"][0]["message"]["content"]
        assert len(chat) >= 5, chat
        chat_stop = chat[2:4]
        chat_kept = c.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, "max_tokens": 12, "temperature": 0,
                                                         "ignore_eos": True, "stop": [chat_stop], "no_stop_trim": True}).json()
    assert (trimmed["text"], trimmed["finish_reason"]) == (full[:cut], "stop")
    assert (kept["text"], kept["finish_reason"]) == (full[: cut + len(stop)], "stop")
    assert chat_kept["choices"][0]["message"]["content"] == chat[: chat.index(chat_stop) + len(chat_stop)]
    server.assert_balanced_idle()


@pytest.mark.parametrize(("path", "field", "value"), [
    ("/v1/completions", "return_hidden_states", True),
    ("/v1/chat/completions", "continue_final_message", True),
    ("/v1/chat/completions", "separate_reasoning", False),
    ("/v1/chat/completions", "stream_reasoning", False),
    ("/v1/chat/completions", "include_reasoning", False),
    ("/v1/chat/completions", "no_stop_trim", "yes"),
])
def test_router_field_values_not_implemented_are_refused(server: ServeProcess, path: str, field: str, value: Any) -> None:
    body = {**(ROUTER_COMPLETION if path == "/v1/completions" else SGLANG_CHAT), field: value}
    with server.http() as c:
        r = c.post(path, json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field, r.json()


def test_probe_routes(server: ServeProcess, tiny_gemma_dir: Any) -> None:
    """No API key needed (like /health); the fields sglang-router reads at registration."""
    with httpx.Client(base_url=server.base, timeout=60) as c:
        info = {path: c.get(path) for path in ("/server_info", "/get_server_info", "/model_info", "/get_model_info",
                                                "/get_load", "/health_generate", "/health")}
    for path, r in info.items():
        assert r.status_code == 200, (path, r.text)
        assert r.headers["x-freetoken-replica"].endswith(f":{server.port}"), r.headers
    server_info, model_info = info["/server_info"].json(), info["/model_info"].json()
    assert info["/get_server_info"].json() == server_info and info["/get_model_info"].json() == model_info
    assert server_info["served_model_name"] == MODEL and server_info["dp_size"] == 1
    assert server_info["model_path"] == model_info["model_path"] == str(tiny_gemma_dir.resolve())
    assert model_info["tokenizer_path"] == str(tiny_gemma_dir.resolve())  # it holds tokenizer.json
    assert (model_info["model_type"], model_info["architectures"]) == ("gemma3_text", ["Gemma3ForCausalLM"])
    assert model_info["is_generation"] is True
    load = info["/get_load"].json()
    assert [sorted(e) for e in load] == [["dp_rank", "num_reqs", "num_tokens", "num_waiting_reqs"]], load
    assert load[0]["dp_rank"] == 0 and all(isinstance(v, int) and v >= 0 for v in load[0].values())
    assert info["/health_generate"].json() == {"status": "ok"}
    server.assert_balanced_idle()


def test_render_gives_the_prefilled_ids(server: ServeProcess) -> None:
    """vllm-router keys its cache-aware tree on these ids: they are what the inference route runs."""
    tools = [{"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {}}}}]
    chat = {"model": MODEL, "messages": MESSAGES, "tools": tools, "max_tokens": 1}
    prompts = {"model": MODEL, "prompt": ["hello there", "a second prompt"], "max_tokens": 1}
    with server.http() as c:
        rendered_chat = c.post("/v1/chat/completions/render", json=chat)
        rendered = c.post("/v1/completions/render", json=prompts)
        served_chat = c.post("/v1/chat/completions", json=chat).json()
        ids = [c.post("/v1/tokenize", json={"model": MODEL, "prompt": p}).json()["tokens"] for p in prompts["prompt"]]
        missing = c.post("/v1/chat/completions/render", json={**chat, "model": "no-such-model"})
    assert rendered_chat.status_code == 200, rendered_chat.text
    assert len(rendered_chat.json()["token_ids"]) == served_chat["usage"]["prompt_tokens"]
    assert [e["token_ids"] for e in rendered.json()] == ids
    assert missing.status_code == 404
    server.assert_balanced_idle()
