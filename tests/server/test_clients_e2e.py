"""The official clients, unmodified, against the shared tiny-model server (all declared in
[test]: a missing client fails, it does not skip): the `openai` SDK's chat path with the shapes current SDKs send (the
`developer` role, a response message re-sent as `model_dump()`, `logit_bias`, the no-op fields,
a streamed forced call whose argument deltas join to a valid call), and the `anthropic` SDK's
`messages.stream` with forced tools, `messages.parse` (output_config.format through the
grammar) and `beta.messages.tool_runner` running a tool (it sends `thread: {"type": "create"}`)."""

from __future__ import annotations

import json
from typing import Any, Literal

import jsonschema
import pytest
from conftest import API_KEY
from serving import ServeProcess

import anthropic  # noqa: E402 - all three are declared in [test]: missing is a failure, not a skip
import openai  # noqa: E402
import pydantic  # noqa: E402

MODEL = "tiny-gemma"
CITIES = ["Paris", "Oslo", "Lima"]
CITY = {"type": "object", "properties": {"city": {"type": "string", "enum": CITIES}}, "required": ["city"], "additionalProperties": False}
ASK: Any = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def oa(server: ServeProcess) -> Any:
    return openai.OpenAI(base_url=f"{server.base}/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def claude(server: ServeProcess) -> Any:
    return anthropic.Anthropic(base_url=server.base, api_key=API_KEY, max_retries=0, timeout=120)


def test_openai_chat_with_current_shapes(oa: Any) -> None:
    first = oa.chat.completions.create(
        model=MODEL, messages=[{"role": "developer", "content": "Be brief."}, *ASK], max_completion_tokens=4, temperature=0,
        store=False, metadata={"run": "e2e"}, service_tier="auto", reasoning_effort="low", prompt_cache_key="e2e",
        safety_identifier="user-1", verbosity="low", logit_bias={str(3 + ord("Z")): 100},
    )
    assert first.choices[0].message.content == "ZZZZ"
    history = [{"role": "developer", "content": "Be brief."}, *ASK, first.choices[0].message.model_dump(), {"role": "user", "content": "And Oslo?"}]
    again = oa.chat.completions.create(model=MODEL, messages=history, max_tokens=3, temperature=0)
    assert again.choices[0].finish_reason in ("stop", "length")


def test_openai_streamed_forced_call(oa: Any) -> None:
    tools: Any = [{"type": "function", "function": {"name": "get_weather", "parameters": CITY}}]
    stream = oa.chat.completions.create(
        model=MODEL, messages=ASK, tools=tools, tool_choice="required", max_tokens=60, temperature=1, stream=True,
        stream_options={"include_usage": True, "include_obfuscation": False},
    )
    pieces, names, finish = [], [], None
    for chunk in stream:
        for choice in chunk.choices:
            for d in choice.delta.tool_calls or []:
                pieces.append(d.function.arguments or "")
                names += [d.function.name] if d.function.name else []
            finish = choice.finish_reason or finish
    assert names == ["get_weather"] and finish == "tool_calls"
    assert len([p for p in pieces if p]) > 1
    jsonschema.validate(json.loads("".join(pieces)), CITY)


def test_anthropic_stream_with_forced_tools(claude: Any) -> None:
    tools = [{"name": "get_weather", "description": "Weather of a city", "input_schema": CITY},
             {"name": "get_time", "description": "Time of a city", "input_schema": CITY}]
    with claude.messages.stream(
        model=MODEL, max_tokens=80, messages=ASK, tools=tools, tool_choice={"type": "tool", "name": "get_time"},
        thinking={"type": "adaptive"}, output_config={"effort": "low"}, extra_body={"temperature": 1},
    ) as stream:
        partial = [ev.partial_json for ev in stream if ev.type == "input_json"]
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use" and [b.type for b in final.content] == ["tool_use"]
    assert final.content[0].name == "get_time" and len(partial) > 1
    jsonschema.validate(final.content[0].input, CITY)


def test_anthropic_parse_structured_output(claude: Any) -> None:
    class Weather(pydantic.BaseModel):
        city: Literal["Paris", "Oslo", "Lima"]
        sunny: bool

    parsed = claude.messages.parse(model=MODEL, max_tokens=60, messages=ASK, output_format=Weather)
    assert parsed.stop_reason == "end_turn"
    assert isinstance(parsed.parsed_output, Weather)


def test_anthropic_tool_runner(claude: Any) -> None:
    calls: list[str] = []

    @anthropic.beta_tool
    def get_weather(city: Literal["Paris", "Oslo", "Lima"]) -> str:
        """The weather of a city."""
        calls.append(city)
        return "18 C, sunny"

    runner = claude.beta.messages.tool_runner(
        model=MODEL, max_tokens=60, messages=ASK, tools=[get_weather], tool_choice={"type": "any"}, max_iterations=2,
    )
    replies = list(runner)  # the second turn continues the thread the first one created
    assert len(replies) == 2 and all(r.stop_reason == "tool_use" for r in replies)
    assert calls and set(calls) <= set(CITIES)  # the runner ran the tool on each call's parsed input


def test_idle_balanced_after_clients(server: ServeProcess) -> None:
    server.assert_balanced_idle()
