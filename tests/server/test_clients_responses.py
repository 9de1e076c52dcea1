"""The Responses API end to end with the real clients, installed from PyPI, on the shared tiny
server: the `openai` SDK's `responses.create` / `responses.stream` / a `previous_response_id`
chain / `responses.parse`, the OpenAI Agents SDK running a function tool on both its Responses
model and its chat-completions model, and `litellm.responses()`. Each client is skipped cleanly
where it is not installed."""

from __future__ import annotations

import asyncio
import json
from typing import Any, Literal

import openai
import pytest
from conftest import API_KEY
from pydantic import BaseModel
from serving import ServeProcess

MODEL = "tiny-gemma"
PAGE = 4
CITIES = ["Paris", "Oslo", "Lima"]
WEATHER: Any = {
    "type": "function", "name": "get_weather", "description": "Current weather of a city", "strict": True,
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": CITIES}},
                   "required": ["city"], "additionalProperties": False},
}


@pytest.fixture(scope="module")
def oa(server: ServeProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def test_openai_responses_create_and_chain(oa: openai.OpenAI, server: ServeProcess) -> None:
    first = oa.responses.create(model=MODEL, instructions="Be brief.", input="Name three rivers of Europe.", max_output_tokens=8, extra_body={"seed": 1})
    assert first.status in ("completed", "incomplete") and isinstance(first.output_text, str)
    assert first.usage is not None and first.usage.output_tokens >= 1
    second = oa.responses.create(model=MODEL, instructions="Be brief.", previous_response_id=first.id, input="And two more?", max_output_tokens=4)
    assert second.usage is not None and first.usage is not None
    earlier = first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens >= (earlier - 1) // PAGE * PAGE
    assert oa.responses.retrieve(second.id).id == second.id
    [item] = oa.responses.input_items.list(second.id).data
    assert item.type == "message" and item.content[0].text == "And two more?"  # type: ignore[union-attr]
    oa.responses.delete(second.id)
    with pytest.raises(openai.NotFoundError):
        oa.responses.retrieve(second.id)
    server.assert_balanced_idle()


def test_openai_responses_stream_helper(oa: openai.OpenAI) -> None:
    """A cut-off response ends with `response.incomplete` (the helper's get_final_response wants
    `response.completed`, as with OpenAI's own server), so the last event's response is read."""
    deltas: list[str] = []
    with oa.responses.stream(model=MODEL, input="Tell me a story.", max_output_tokens=10) as stream:
        for event in stream:
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
    assert event.type in ("response.completed", "response.incomplete")
    assert "".join(deltas) == event.response.output_text and event.response.status == event.type.split(".")[1]


def test_openai_responses_stream_with_a_forced_tool(oa: openai.OpenAI) -> None:
    with oa.responses.stream(model=MODEL, input="Weather in Lima?", tools=[WEATHER], tool_choice="required", max_output_tokens=120) as stream:
        args = "".join(e.delta for e in stream if e.type == "response.function_call_arguments.delta")
        final = stream.get_final_response()
    [call] = [item for item in final.output if item.type == "function_call"]
    assert call.arguments == args and json.loads(args)["city"] in CITIES


class Pick(BaseModel):
    city: Literal["Paris", "Oslo", "Lima"]


def test_openai_responses_parse(oa: openai.OpenAI) -> None:
    out = oa.responses.parse(model=MODEL, input="Pick a city.", text_format=Pick, max_output_tokens=60)
    assert isinstance(out.output_parsed, Pick) and out.output_parsed.city in CITIES


def _agents() -> Any:
    import agents  # openai-agents is declared in [test]: missing is a failure, not a skip
    agents.set_tracing_disabled(True)  # no trace export (no network)
    return agents


@pytest.mark.parametrize(("wire", "streamed"), [("responses", False), ("responses", True), ("chat", False)])
def test_openai_agents_sdk_runs_a_function_tool(server: ServeProcess, wire: str, streamed: bool) -> None:
    agents = _agents()
    seen: list[str] = []

    @agents.function_tool
    def get_weather(city: Literal["Paris", "Oslo", "Lima"]) -> str:
        """Current weather of a city."""
        seen.append(city)
        return f"sunny in {city}"

    client = openai.AsyncOpenAI(base_url=f"{server.base}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    model_cls = agents.OpenAIResponsesModel if wire == "responses" else agents.OpenAIChatCompletionsModel
    agent = agents.Agent(
        name="weather",
        instructions="Answer with the weather tool.",
        tools=[get_weather],
        model=model_cls(model=MODEL, openai_client=client),
        model_settings=agents.ModelSettings(tool_choice="required", max_tokens=120),
        tool_use_behavior="stop_on_first_tool",
    )
    async def run() -> Any:
        if not streamed:
            return await agents.Runner.run(agent, "What is the weather in Paris?", max_turns=3)
        result = agents.Runner.run_streamed(agent, "What is the weather in Paris?", max_turns=3)
        async for _ in result.stream_events():
            pass
        return result

    result = asyncio.run(run())
    assert len(seen) == 1 and seen[0] in CITIES
    assert result.final_output == f"sunny in {seen[0]}"
    server.assert_balanced_idle()


@pytest.mark.litellm
def test_litellm_responses(server: ServeProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch of the price list
    litellm = pytest.importorskip("litellm", reason="litellm is not installed: not declared (it pins botocore); marker `litellm`")
    out = litellm.responses(model=f"openai/{MODEL}", input="Say hi.", max_output_tokens=4, api_base=f"{server.base}/v1", api_key=API_KEY)
    assert out.status in ("completed", "incomplete") and out.usage.output_tokens >= 1
