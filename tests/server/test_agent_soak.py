"""A tool-calling soak on the tiny sliding-window model (window 7, page 4) with small pools:
4 conversations at once over one long shared system prompt that lists tools, four turns each
with tool calls (forced through the grammar, so the random model makes real calls) and tool
results fed back. Bounded: 16 requests. No error, every later turn reuses its prefix
(`cached_tokens` > 0), and at idle the pools balance with no audit violation."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from serving import ServeProcess, serving

MODEL = "tiny-gemma-long"
CONVERSATIONS = 4
CITIES = ["Paris", "Oslo", "Lima"]
CITY = {"type": "object", "properties": {"city": {"type": "string", "enum": CITIES}}, "required": ["city"], "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": CITY}},
    {"type": "function", "function": {"name": "get_time", "description": "Local time", "parameters": CITY}},
]
SYSTEM = " ".join(["You are a careful agent that answers travel questions with tools."] * 4)
# Turns: (tool_choice, max_tokens); forced turns make a call whose result is fed back.
TURNS: list[tuple[Any, int]] = [
    ("required", 80),
    ({"type": "function", "function": {"name": "get_time"}}, 80),
    ("auto", 6),
    ("required", 80),
]
FLAGS = [
    "--page-size", "4", "--num-tokens", "2400", "--max-running-requests", "4", "--max-waiting-requests", "8",
    "--max-prefill-length", "64", "--enable-cache-report", "--debug-kv", "--dtype", "float32", "--threads", "1",
    "--served-model-name", MODEL,
]


@pytest.fixture(scope="module")
def soak_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    from tiny_models import write_tiny_model

    model = write_tiny_model("gemma3", tmp_path_factory.mktemp("soak_model") / "tiny-gemma", max_position_embeddings=2048)
    with serving(str(model), FLAGS, Path(tmp_path_factory.mktemp("soak_logs")) / "soak.log") as proc:
        yield proc


def conversation(server: ServeProcess, k: int, cached: list[int], errors: list[str]) -> None:
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    with httpx.Client(base_url=server.base, timeout=300) as c:
        for turn, (choice, max_tokens) in enumerate(TURNS):
            messages.append({"role": "user", "content": f"Trip {k}, question {turn}: what about {CITIES[(k + turn) % 3]}?"})
            body = {"model": MODEL, "messages": messages, "tools": TOOLS, "tool_choice": choice, "max_tokens": max_tokens,
                    "temperature": 0.9, "seed": 100 * k + turn}
            r = c.post("/v1/chat/completions", json=body)
            if r.status_code != 200:
                errors.append(f"conversation {k} turn {turn}: {r.status_code} {r.text}")
                return
            out = r.json()
            cached.append(out["usage"]["prompt_tokens_details"]["cached_tokens"])
            choice_out = out["choices"][0]
            message = choice_out["message"]
            calls = message.get("tool_calls") or []
            if choice != "auto" and (choice_out["finish_reason"] != "tool_calls" or len(calls) != 1):
                errors.append(f"conversation {k} turn {turn}: no forced call: {choice_out}")
                return
            messages.append({"role": "assistant", "content": message.get("content"), **({"tool_calls": calls} if calls else {})})
            for call in calls:
                args = json.loads(call["function"]["arguments"])
                result = {"city": args.get("city"), "value": f"{call['function']['name']} result {k}.{turn}"}
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": json.dumps(result)})


def test_concurrent_tool_calling_soak(soak_server: ServeProcess) -> None:
    errors: list[str] = []
    cached: dict[int, list[int]] = {k: [] for k in range(CONVERSATIONS)}
    threads = [threading.Thread(target=conversation, args=(soak_server, k, cached[k], errors)) for k in range(CONVERSATIONS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not any(t.is_alive() for t in threads), "a conversation did not finish"
    assert not errors, errors[:2]
    assert all(len(v) == len(TURNS) for v in cached.values()), cached
    assert all(all(hit > 0 for hit in v[1:]) for v in cached.values()), cached
    with soak_server.http() as c:
        assert c.get("/health").status_code == 200
    status = soak_server.assert_balanced_idle()
    for pool in status["pools"].values():
        assert pool["in_use"] == 0 and pool["quarantined"] == 0, pool
