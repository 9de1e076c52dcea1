"""Tool calling over real HTTP on the tiny sliding-window model (ChatML template, so Hermes
`<tool_call>` format), with the `openai` client: forced calls (`required`, named) through the
engine's grammar, streamed and not, the round trip with tool results fed back, `none`, request
errors; and the rendering of tools, calls and results into templates that know none of them."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest
from conftest import API_KEY
from serving import ServeProcess

from freetoken.server.core.tool_messages import prepare_messages, template_support
from freetoken.tokenizer import Tokenizer
from freetoken.families.gemma3 import CHAT_TEMPLATE as GEMMA3_CHAT_TEMPLATE
from freetoken.tokenizer.tool_parsers import make_tool_parser

MODEL = "tiny-gemma"
CITIES = ["Paris", "Oslo", "Lima"]
TOOLS: Any = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": CITIES}},
                       "required": ["city"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "Local time of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": CITIES}},
                       "required": ["city"], "additionalProperties": False}}},
]
NAMES = {"get_weather", "get_time"}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def oa(server: ServeProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def check_call(call: Any, name: str | None = None) -> dict[str, Any]:
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name in NAMES and (name is None or call.function.name == name)
    args = json.loads(call.function.arguments)
    assert set(args) == {"city"} and args["city"] in CITIES
    return args


def test_required_forces_a_call(oa: openai.OpenAI) -> None:
    out = oa.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, tool_choice="required", max_tokens=120, temperature=1.0, seed=3)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.tool_calls and len(choice.message.tool_calls) == 1
    check_call(choice.message.tool_calls[0])
    assert not choice.message.content


def test_named_function_forces_that_call(oa: openai.OpenAI) -> None:
    for seed in (1, 2):
        out = oa.chat.completions.create(
            model=MODEL, messages=USER, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}},
            max_tokens=120, temperature=1.0, seed=seed,
        )
        assert out.choices[0].finish_reason == "tool_calls"
        check_call(out.choices[0].message.tool_calls[0], "get_time")


def test_logprobs_of_a_call_streamed_and_not(server: ServeProcess) -> None:
    """A forced call's tokens have logprobs, the same non-streamed as joined from the stream."""
    body = {"model": MODEL, "messages": USER, "tools": TOOLS, "tool_choice": "required", "max_tokens": 120, "temperature": 0,
            "logprobs": True, "top_logprobs": 2}
    with server.http() as c:
        out = c.post("/v1/chat/completions", json=body).json()
        lines = c.post("/v1/chat/completions", json={**body, "stream": True}).text.splitlines()
    choice = out["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["tool_calls"], out
    logprobs = choice["logprobs"]["content"]
    assert len(logprobs) == out["usage"]["completion_tokens"]
    chunks = [json.loads(line[6:])["choices"] for line in lines if line.startswith("data: {")]
    streamed = [lp for c in chunks if c and c[0]["logprobs"] for lp in c[0]["logprobs"]["content"]]
    assert [e["token"] for e in streamed] == [e["token"] for e in logprobs]
    assert [e["logprob"] for e in streamed] == pytest.approx([e["logprob"] for e in logprobs], abs=1e-3)
    assert all(len(e["top_logprobs"]) == 2 for e in logprobs)
    assert -9999.0 in [t["logprob"] for e in logprobs for t in e["top_logprobs"]]  # ruled out by the grammar: not -inf


def stream_call(oa: openai.OpenAI, messages: Any, tool_choice: Any) -> tuple[str, list[dict[str, Any]], str | None]:
    """Content, the tool calls assembled from the deltas as a client does, and the finish reason."""
    content, calls, finish = "", {}, None
    for chunk in oa.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, tool_choice=tool_choice, max_tokens=120, temperature=1.0, seed=5, stream=True,
    ):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for d in choice.delta.tool_calls or []:
                slot = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                slot["id"] = d.id or slot["id"]
                slot["name"] += d.function.name or ""
                slot["arguments"] += d.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


def test_required_streamed_as_tool_call_deltas(oa: openai.OpenAI) -> None:
    content, calls, finish = stream_call(oa, USER, "required")
    assert finish == "tool_calls" and len(calls) == 1 and not content.strip()
    assert calls[0]["id"].startswith("call_") and calls[0]["name"] in NAMES
    assert json.loads(calls[0]["arguments"])["city"] in CITIES


@pytest.mark.parametrize("stream", [False, True])
def test_round_trip_with_tool_results(oa: openai.OpenAI, server: ServeProcess, stream: bool) -> None:
    """Call, run the tool, feed the result back, get an answer; then a second call on top."""
    messages: Any = [{"role": "system", "content": "You are a weather assistant."}, *USER]
    for turn in range(2):
        if stream:
            _, calls, finish = stream_call(oa, messages, "required")
            tool_calls = [{"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}} for c in calls]
        else:
            out = oa.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice="required", max_tokens=120, seed=turn)
            finish, msg = out.choices[0].finish_reason, out.choices[0].message
            tool_calls = [c.model_dump() for c in msg.tool_calls or []]
        assert finish == "tool_calls" and len(tool_calls) == 1
        messages.append({"role": "assistant", "content": None, "tool_calls": tool_calls})
        city = json.loads(tool_calls[0]["function"]["arguments"])["city"]
        messages.append({"role": "tool", "tool_call_id": tool_calls[0]["id"], "content": json.dumps({"city": city, "temp_c": 18 + turn})})
        answer = oa.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=8, seed=turn)  # auto
        choice = answer.choices[0]
        assert choice.finish_reason in ("stop", "length", "tool_calls")
        assert choice.message.content is not None or choice.message.tool_calls
        messages.append({"role": "assistant", "content": choice.message.content or ""})
        messages.append({"role": "user", "content": "And now?"})
    server.assert_balanced_idle()


def test_none_and_auto_return_text(oa: openai.OpenAI) -> None:
    for choice in ("none", "auto"):
        out = oa.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, tool_choice=choice, max_tokens=6, temperature=0)
        c = out.choices[0]
        assert c.finish_reason in ("stop", "length", "tool_calls")
        assert c.message.tool_calls or isinstance(c.message.content, str)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
        ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
        ({"tools": [TOOLS[0], TOOLS[0]]}, "tools"),
    ],
)
def test_bad_tool_requests_are_400(server: ServeProcess, body: dict[str, Any], param: str) -> None:
    with server.http() as c:
        r = c.post("/v1/chat/completions", json={"model": MODEL, "messages": USER, "max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


# ---- rendering (no server) ---------------------------------------------------------------------

HISTORY: Any = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
    {"role": "tool", "tool_call_id": "call_a", "content": "RESULT-7C"},
    {"role": "user", "content": "Thanks. And Lima?"},
]


def test_chatml_template_gets_the_tool_prompt_and_history(tiny_gemma_dir: Any) -> None:
    tok = Tokenizer.from_pretrained_dir(tiny_gemma_dir)
    assert template_support(tok) == (False, False, True)
    parser = make_tool_parser("hermes", NAMES)
    messages, tools = prepare_messages(tok, HISTORY, TOOLS, parser, parallel=True)
    assert tools is None
    text = tok.apply_chat_template(messages)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools") and '"name": "get_weather"' in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in text
    assert "<|im_start|>tool\nRESULT-7C<|im_end|>" in text


def test_gemma_template_gets_tool_results_as_user_turns() -> None:
    gemma = _template_only_tokenizer(GEMMA3_CHAT_TEMPLATE)
    parser = make_tool_parser("gemma", NAMES)
    messages, _ = prepare_messages(gemma, HISTORY, TOOLS, parser, parallel=False)
    text = gemma.apply_chat_template(messages)  # the template raises unless turns alternate
    assert '```tool_call\n{"name": "get_weather", "parameters": {"city": "Oslo"}}\n```' in text
    assert "<start_of_turn>user\n```tool_output\nRESULT-7C\n```\nThanks. And Lima?<end_of_turn>" in text
    assert "Call at most one function." in text


def _template_only_tokenizer(template: str) -> Tokenizer:
    from tokenizers import Tokenizer as Backend
    from tokenizers import models

    return Tokenizer(Backend(models.BPE()), bos_id=None, eos_id=None, chat_template=template)


def test_template_that_renders_tools_gets_them() -> None:
    template = (
        "{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}{% endif %}"
        "{% for m in messages %}[{{ m.role }}]{{ m.content }}"
        "{% for c in m.tool_calls or [] %}CALL {{ c.function.name }} {{ c.function.arguments.city }}{% endfor %}{% endfor %}"
    )
    tok = _template_only_tokenizer(template)
    assert template_support(tok) == (True, True, True)
    messages, tools = prepare_messages(tok, HISTORY, TOOLS, make_tool_parser("hermes", NAMES), parallel=True)
    assert tools == TOOLS
    text = tok.apply_chat_template(messages, tools=tools)
    assert text.startswith("TOOLS:get_weather;get_time;") and "CALL get_weather Oslo" in text  # arguments as an object
