"""The request bodies Codex 0.171.0 and Claude Code 2.1.332 sent to `ft serve` (captured through a
logging proxy, saved under fixtures/ with long strings cut), replayed over real HTTP against a
tiny model whose context holds them, and the answers read as those clients read them: every Codex
event validated as the `openai` SDK's `ResponseStreamEvent`, every Claude Code event as the
`anthropic` SDK's `RawMessageStreamEvent` and accumulated by the SDK's own stream accumulator.
The server reads Gemma's fenced tool-call format, as the real Gemma's does, and its calls stream
their arguments while written: checked through the `openai` SDK's stream helpers on chat and
Responses. The real CLIs run in test_clients_agent_cli.py (marker `agent_cli`)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from anthropic.lib.streaming._messages import accumulate_event
from anthropic.types import RawMessageStreamEvent
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter
from serving import ServeProcess, serving

FIXTURES = Path(__file__).resolve().parent / "fixtures"
CODEX = "codex_0.171.0_first_turn.json"
CLAUDE = ["claude_code_2.1.332_first_turn.json", "claude_code_2.1.332_resumed.json"]
RESPONSE_EVENT = TypeAdapter(ResponseStreamEvent)
MESSAGE_EVENT = TypeAdapter(RawMessageStreamEvent)
FLAGS = ["--page-size", "16", "--num-tokens", "32768", "--max-prefill-length", "2048", "--dtype", "float32", "--threads", "1",
         "--tool-call-parser", "gemma"]
CITIES = ["Paris", "Oslo", "Lima"]
WEATHER: Any = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": CITIES}, "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def agent_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    """The tiny Gemma with a 16k context: the captured prompts are 5-9k of its byte-level tokens."""
    from tiny_models import write_tiny_model

    model = write_tiny_model("gemma3", tmp_path_factory.mktemp("agent_replay") / "tiny-gemma-16k", max_position_embeddings=16384)
    with serving(str(model), FLAGS, tmp_path_factory.mktemp("agent_replay_logs") / "serve.log") as proc:
        yield proc


def fixture(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / name).read_text())


def sse(response: httpx.Response) -> list[tuple[str, dict[str, Any]]]:
    """(event name, data) of each server-sent event."""
    events = []
    for block in response.text.split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)
        if "data" in lines:
            events.append((lines.get("event", ""), json.loads(lines["data"])))
    return events


def test_codex_first_turn_streams_as_codex_reads_it(agent_server: ServeProcess) -> None:
    captured = fixture(CODEX)
    body = {**captured["body"], "max_output_tokens": 12}  # the captured body leaves it to the context
    assert body["store"] is False and body["include"] == ["reasoning.encrypted_content"]
    roles = [item.get("role") for item in body["input"]]
    assert roles[:2] == ["developer", "developer"] and roles[-2:] == ["user", "user"]  # the shape Gemma's template needs merged
    r = httpx.post(f"{agent_server.base}/v1/responses", json=body, headers=captured["headers"], timeout=300)
    assert r.status_code == 200, r.text
    assert r.headers["x-freetoken-ignored-tools"].split(",") == ["namespace", "web_search"]
    events = sse(r)
    parsed = [RESPONSE_EVENT.validate_python(data) for _, data in events]
    assert [name for name, _ in events] == [e.type for e in parsed]
    assert [e.sequence_number for e in parsed] == list(range(len(parsed)))
    assert parsed[0].type == "response.created" and parsed[-1].type in ("response.completed", "response.incomplete")
    final = parsed[-1].response  # type: ignore[union-attr]
    # Codex keeps the items of output_item.done and the usage of the last event
    done = [e.item for e in parsed if e.type == "response.output_item.done"]  # type: ignore[union-attr]
    assert [i.id for i in done] == [i.id for i in final.output] and done
    text = "".join(e.delta for e in parsed if e.type == "response.output_text.delta")  # type: ignore[union-attr]
    assert text == final.output_text
    assert final.usage is not None and (final.usage.output_tokens == 12 or final.status == "completed")
    assert [t.name for t in final.tools] == [t["name"] for t in body["tools"] if t["type"] == "function"]  # type: ignore[union-attr]
    agent_server.assert_balanced_idle()


@pytest.mark.parametrize("name", CLAUDE)
def test_claude_code_turn_streams_as_claude_code_reads_it(agent_server: ServeProcess, name: str) -> None:
    captured = fixture(name)
    body = {**captured["body"], "max_tokens": 12}
    assert body["thinking"]["type"] == "adaptive" and "context_management" in body and "effort" in body["output_config"]
    assert any(m["role"] == "system" for m in body["messages"])  # the mid-conversation system message
    r = httpx.post(f"{agent_server.base}/v1/messages", json=body, headers=captured["headers"], timeout=300)
    assert r.status_code == 200, r.text
    events = [(name, data) for name, data in sse(r) if name != "ping"]  # the SDK skips pings
    parsed = [MESSAGE_EVENT.validate_python(data) for _, data in events]
    assert [name for name, _ in events] == [e.type for e in parsed]
    assert parsed[0].type == "message_start" and parsed[-1].type == "message_stop"
    message, json_bufs = None, {}
    for event in parsed:
        message = accumulate_event(event=event, current_snapshot=message, json_bufs=json_bufs)
    assert message is not None and message.stop_reason in ("end_turn", "max_tokens", "tool_use")
    text = "".join(e.delta.text for e in parsed if e.type == "content_block_delta" and e.delta.type == "text_delta")  # type: ignore[union-attr]
    assert "".join(b.text for b in message.content if b.type == "text") == text
    assert message.usage.output_tokens <= 12
    agent_server.assert_balanced_idle()


def test_claude_code_sessions_share_the_cached_system_prompt(agent_server: ServeProcess) -> None:
    """Claude Code's first system block, its billing line, differs with every prompt (`cc_version=
    2.1.332.58d` here, `.cfd` for another prompt); it is left out, so another session's request over
    the same system prompt and tools reads them from the cache."""
    captured = fixture(CLAUDE[0])
    billing = captured["body"]["system"][0]["text"]
    assert billing.startswith("x-anthropic-billing-header: cc_version=")
    usages = []
    for version, prompt in (("58d", "Say hello."), ("cfd", "Reply with one word.")):
        body = {**captured["body"], "max_tokens": 2, "stream": False}
        body["system"] = [{**body["system"][0], "text": billing.replace("58d", version)}, *body["system"][1:]]
        body["messages"] = [{"role": "user", "content": prompt}]
        r = httpx.post(f"{agent_server.base}/v1/messages", json=body, headers=captured["headers"], timeout=300)
        assert r.status_code == 200, r.text
        usages.append(r.json()["usage"])
    assert usages[1]["cache_read_input_tokens"] > 10 * usages[1]["input_tokens"]


def test_gemma_calls_stream_their_arguments_on_chat(agent_server: ServeProcess) -> None:
    """A forced call in Gemma's fenced format, streamed through the SDK's `chat.completions.stream`:
    the arguments arrive in several deltas and join to the non-streamed call's arguments."""
    oa = openai.OpenAI(base_url=f"{agent_server.base}/v1", api_key="unused", max_retries=0, timeout=120)
    kwargs: Any = {"model": "default", "messages": [{"role": "user", "content": "Weather in Oslo, in celsius?"}], "tools": [WEATHER],
                   "tool_choice": "required", "max_tokens": 120, "temperature": 0.0}
    whole = oa.chat.completions.create(**kwargs).choices[0]
    fragments: list[str] = []
    with oa.chat.completions.stream(**kwargs) as stream:
        for event in stream:
            if event.type == "tool_calls.function.arguments.delta":
                fragments.append(event.arguments_delta)
        final = stream.get_final_completion().choices[0]
    assert whole.finish_reason == final.finish_reason == "tool_calls"
    [call] = final.message.tool_calls or []
    assert call.function.name == "get_weather" and len(fragments) > 1
    assert "".join(fragments) == call.function.arguments == (whole.message.tool_calls or [])[0].function.arguments
    assert json.loads(call.function.arguments)["city"] in CITIES


def test_gemma_calls_stream_their_arguments_on_responses(agent_server: ServeProcess) -> None:
    oa = openai.OpenAI(base_url=f"{agent_server.base}/v1", api_key="unused", max_retries=0, timeout=120)
    tool = {"type": "function", **WEATHER["function"]}
    kwargs: Any = {"model": "default", "input": "Weather in Lima, in fahrenheit?", "tools": [tool], "tool_choice": "required",
                   "max_output_tokens": 120, "temperature": 0.0}
    whole = next(i for i in oa.responses.create(**kwargs).output if i.type == "function_call")
    with oa.responses.stream(**kwargs) as stream:
        fragments = [e.delta for e in stream if e.type == "response.function_call_arguments.delta"]
        final = stream.get_final_response()
    call = next(i for i in final.output if i.type == "function_call")
    assert len(fragments) > 1 and "".join(fragments) == call.arguments == whole.arguments  # type: ignore[union-attr]
