"""A server whose chat template thinks in `<think>` (its generation prompt opens the reasoning
unless `enable_thinking` is false, as DeepSeek R1's and Qwen 3's do), started with
`--allowed-origins` and `--unprefixed-routes` on a tiny model with a longer context: the
reasoning parser found from the template (`reasoning_content` on chat, `thinking` blocks on
Messages when asked for, none when not), CORS preflight and headers, the OpenAI routes without
`/v1` (API key still required), and a Claude-Code-shaped first request (24 tools, system blocks
with cache_control, a mid-conversation system message, thinking adaptive, context_management,
output_config.effort, streamed)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from conftest import API_KEY
from serving import ServeProcess, serving

MODEL = "tiny-think"
ORIGIN = "http://app.example"
THINK_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and not enable_thinking %}{{ '<think>\\n\\n</think>\\n\\n' }}{% else %}{{ '<think>\\n' }}{% endif %}"
    "{% endif %}"
)
USER: Any = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def think_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    from tiny_models import write_tiny_model

    root = tmp_path_factory.mktemp("think")
    model = write_tiny_model("gemma3", root / MODEL, max_position_embeddings=8192)
    template = root / "think.jinja"
    template.write_text(THINK_TEMPLATE)
    flags = ["--page-size", "16", "--num-tokens", "16384", "--max-running-requests", "2", "--max-prefill-length", "1024",
             "--dtype", "float32", "--threads", "1", "--chat-template", str(template), "--served-model-name", MODEL,
             "--allowed-origins", f"{ORIGIN},http://other.example", "--unprefixed-routes"]
    with serving(str(model), flags, root / "serve.log", api_key=API_KEY) as proc:
        yield proc


def post(server: ServeProcess, path: str, body: dict[str, Any]) -> httpx.Response:
    with server.http() as c:
        return c.post(path, json=body)


def test_chat_reasoning_content(think_server: ServeProcess) -> None:
    """The prompt opened `<think>`: the tiny model's output is all reasoning, none of it content."""
    r = post(think_server, "/v1/chat/completions", {"model": MODEL, "messages": USER, "max_tokens": 6, "temperature": 0})
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    assert message["reasoning_content"] and not message["content"], message
    r = post(think_server, "/v1/chat/completions", {"model": MODEL, "messages": USER, "max_tokens": 6, "temperature": 0, "stream": True})
    deltas = [json.loads(line[6:])["choices"] for line in r.text.splitlines() if line.startswith("data: {")]
    streamed = "".join(c[0]["delta"].get("reasoning_content", "") for c in deltas if c)
    assert streamed == message["reasoning_content"]
    assert not "".join(c[0]["delta"].get("content", "") for c in deltas if c)


def chat_logprobs_both_ways(server: ServeProcess, body: dict[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A chat request's non-streamed response, and the logprobs of its streamed twin joined."""
    body = {"model": MODEL, "temperature": 0, "logprobs": True, "top_logprobs": 1, **body}
    r = post(server, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    r2 = post(server, "/v1/chat/completions", {**body, "stream": True})
    chunks = [json.loads(line[6:])["choices"] for line in r2.text.splitlines() if line.startswith("data: {")]
    streamed = [lp for c in chunks if c and c[0]["logprobs"] for lp in c[0]["logprobs"]["content"]]
    return r.json(), streamed


def test_chat_logprobs_of_reasoning(think_server: ServeProcess) -> None:
    """An all-reasoning output: the non-streamed logprobs cover every generated token, the same
    tokens (and values) as the stream's."""
    out, streamed = chat_logprobs_both_ways(think_server, {"messages": USER, "max_tokens": 6})
    choice = out["choices"][0]
    assert choice["message"]["reasoning_content"] and not choice["message"]["content"]
    logprobs = choice["logprobs"]["content"]
    assert len(logprobs) == out["usage"]["completion_tokens"] == 6
    assert [e["token"] for e in streamed] == [e["token"] for e in logprobs]
    assert [e["logprob"] for e in streamed] == pytest.approx([e["logprob"] for e in logprobs], abs=1e-3)


def test_messages_thinking_blocks_only_when_asked(think_server: ServeProcess) -> None:
    body = {"model": MODEL, "messages": USER, "max_tokens": 6, "temperature": 0}
    thinking = post(think_server, "/v1/messages", {**body, "thinking": {"type": "adaptive"}}).json()
    assert [b["type"] for b in thinking["content"]] == ["thinking", "text"], thinking
    assert thinking["content"][0]["thinking"] and thinking["content"][0]["signature"] == ""
    plain = post(think_server, "/v1/messages", body).json()  # not asked: enable_thinking false, the template closes it
    assert [b["type"] for b in plain["content"]] == ["text"] and plain["content"][0]["text"], plain
    with think_server.http() as c:
        r = c.post("/v1/messages", json={**body, "thinking": {"type": "enabled", "budget_tokens": 1024}, "stream": True})
    datas = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    starts = [d["content_block"]["type"] for d in datas if d["type"] == "content_block_start"]
    assert starts[0] == "thinking", starts
    streamed = "".join(d["delta"]["thinking"] for d in datas if d["type"] == "content_block_delta" and d["delta"]["type"] == "thinking_delta")
    assert streamed == thinking["content"][0]["thinking"]
    omitted = post(think_server, "/v1/messages", {**body, "thinking": {"type": "adaptive", "display": "omitted"}}).json()
    assert omitted["content"][0] == {"type": "thinking", "thinking": "", "signature": ""}


def test_thinking_budget_ends_the_reasoning(think_server: ServeProcess) -> None:
    """`thinking.budget_tokens` N: the tiny model never closes its reasoning on its own; with the
    budget the engine writes `</think>` after N tokens and the answer follows. The thinking block
    is the same N greedy tokens a request stopped at exactly N (max_tokens) thinks, and without a
    budget (adaptive) the same room is all thinking."""
    budget = 1024
    body = {"model": MODEL, "messages": USER, "temperature": 0}
    enabled = {"type": "enabled", "budget_tokens": budget}
    at_budget = post(think_server, "/v1/messages", {**body, "max_tokens": budget, "thinking": enabled}).json()
    past = post(think_server, "/v1/messages", {**body, "max_tokens": budget + 40, "thinking": enabled}).json()
    unbounded = post(think_server, "/v1/messages", {**body, "max_tokens": budget + 40, "thinking": {"type": "adaptive"}}).json()
    assert at_budget["usage"]["output_tokens"] == budget and at_budget["stop_reason"] == "max_tokens", at_budget["usage"]
    thought = at_budget["content"][0]["thinking"]
    assert [b["type"] for b in past["content"]] == ["thinking", "text"], past
    assert past["content"][0]["thinking"].strip() == thought.strip()  # at most N tokens of thinking
    assert past["content"][1]["text"].strip() and past["usage"]["output_tokens"] > budget + len("</think>")
    assert [b["type"] for b in unbounded["content"]] == ["thinking", "text"] and not unbounded["content"][1]["text"]
    assert len(unbounded["content"][0]["thinking"]) > len(thought) and unbounded["content"][0]["thinking"].startswith(thought.strip())


def test_cors(think_server: ServeProcess) -> None:
    pre = httpx.options(f"{think_server.base}/v1/chat/completions", headers={
        "Origin": ORIGIN, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization,content-type"})
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == ORIGIN  # preflight needs no key
    with think_server.http() as c:
        r = c.get("/v1/models", headers={"Origin": ORIGIN})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
        assert "access-control-allow-origin" not in c.get("/v1/models", headers={"Origin": "http://evil.example"}).headers


def test_unprefixed_routes(think_server: ServeProcess) -> None:
    with think_server.http() as c:
        r = c.post("/chat/completions", json={"model": MODEL, "messages": USER, "max_tokens": 2})
        assert r.status_code == 200 and r.json()["object"] == "chat.completion", r.text
        assert c.get("/models").json()["data"][0]["id"] == MODEL
        assert c.post("/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1}).status_code == 200
    assert httpx.post(f"{think_server.base}/chat/completions", json={"model": MODEL, "messages": USER}).status_code == 401
    assert httpx.get(f"{think_server.base}/health").status_code == 200
    assert httpx.get(f"{think_server.base}/").status_code == 200  # the dashboard page is open; its data is not
    assert httpx.get(f"{think_server.base}/admin/activity").status_code == 401


def claude_code_request() -> dict[str, Any]:
    schema = {"type": "object", "properties": {"path": {"type": "string", "description": "An absolute path."}},
              "required": ["path"], "additionalProperties": False, "$schema": "http://json-schema.org/draft-07/schema#"}
    tools = [{"name": f"Tool{k}", "description": f"Tool number {k}.", "input_schema": schema} for k in range(24)]
    return {
        "model": MODEL, "max_tokens": 8, "stream": True, "temperature": 1,
        "system": [{"type": "text", "text": "You are a CLI.", "cache_control": {"type": "ephemeral"}},
                   {"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral", "ttl": "1h"}}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "<system-reminder>ctx</system-reminder>"},
                                         {"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}]},
            {"role": "system", "content": "Mid-conversation note."},
            {"role": "user", "content": "list files"},
        ],
        "tools": tools,
        "metadata": {"user_id": "user_abc_account__session_1"},
        "thinking": {"type": "adaptive"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "medium"},
    }


def test_claude_code_first_request_is_served(think_server: ServeProcess) -> None:
    with think_server.http() as c:
        r = c.post("/v1/messages", json=claude_code_request(), headers={"anthropic-beta": "mid-conversation-system-2025-01-01"})
        count = c.post("/v1/messages/count_tokens", json={k: v for k, v in claude_code_request().items()
                                                          if k not in ("max_tokens", "stream", "temperature", "metadata")})
    assert r.status_code == 200, r.text
    events = [line.removeprefix("event: ") for line in r.text.splitlines() if line.startswith("event: ")]
    assert events[0] == "message_start" and events[-2:] == ["message_delta", "message_stop"], events
    assert count.status_code == 200 and count.json()["input_tokens"] > 1024  # past the shared tiny model's context


def test_idle_balanced(think_server: ServeProcess) -> None:
    think_server.assert_balanced_idle()
