"""Anthropic Messages over real HTTP with the official `anthropic` client on the shared tiny-model
server: messages, streaming in Anthropic's event order, stop sequences, tool use (calls forced by
the engine's grammar with `tool_choice` `tool` / `any`, streamed and not, `tool_result` fed back;
`none` gives text), count_tokens against /v1/tokenize, prefix-cache reads in usage, and errors in
Anthropic's shape raising the client's exception types. The conversion of content blocks into
chat messages is also checked on its own."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import jsonschema
import pytest
from conftest import API_KEY
from serving import ServeProcess

from freetoken.server.anthropic.protocol import MessagesRequest
from freetoken.server.core.tool_messages import prepare_messages
from freetoken.tokenizer import Tokenizer
from freetoken.tokenizer.tool_parsers import make_tool_parser

MODEL = "tiny-gemma"
GREEDY = {"temperature": 0}  # this anthropic client has no sampling arguments of its own
HELLO: Any = [{"role": "user", "content": "Hello, world! How are you today?"}]
TOOL_TURNS: Any = [
    {"role": "user", "content": "What is the weather like in Paris?"},
    {
        "role": "assistant",
        "content": [
            {"type": "text", "text": "Let me check."},
            {"type": "tool_use", "id": "toolu_01", "name": "get_weather", "input": {"city": "Paris", "unit": "celsius"}},
        ],
    },
    {
        "role": "user",
        "content": [
            {"type": "tool_result", "tool_use_id": "toolu_01", "content": [{"type": "text", "text": "18 C, sunny"}]},
            {"type": "text", "text": "Thanks!"},
        ],
    },
]
TOOL_TURNS_AS_CHAT = [
    {"role": "system", "content": "You are a weather bot."},
    {"role": "user", "content": "What is the weather like in Paris?"},
    {
        "role": "assistant",
        "content": "Let me check.",
        "tool_calls": [
            {"id": "toolu_01", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "toolu_01", "content": "18 C, sunny"},
    {"role": "user", "content": "Thanks!"},
]


@pytest.fixture(scope="module")
def client(server: ServeProcess) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base, api_key=API_KEY, max_retries=0, timeout=120)


def tokenize(server: ServeProcess, messages: list[dict[str, Any]]) -> dict[str, Any]:
    with server.http() as c:
        r = c.post("/v1/tokenize", json={"messages": messages})
    assert r.status_code == 200, r.text
    return r.json()


def test_blocks_convert_to_chat_messages() -> None:
    req = MessagesRequest.model_validate(
        {"model": MODEL, "max_tokens": 4, "system": [{"type": "text", "text": "You are a weather bot."}], "messages": TOOL_TURNS}
    )
    assert req.chat_messages() == TOOL_TURNS_AS_CHAT
    errored = MessagesRequest.model_validate(
        {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "a"}, {"type": "tool_result", "tool_use_id": "t", "content": "boom", "is_error": True},
            {"type": "text", "text": "b"}, {"type": "text", "text": "c"}]}]}
    )
    assert errored.chat_messages() == [
        {"role": "user", "content": "a"}, {"role": "tool", "tool_call_id": "t", "content": "Error: boom"}, {"role": "user", "content": "b\nc"},
    ]


def test_message(client: anthropic.Anthropic) -> None:
    msg = client.messages.create(model=MODEL, max_tokens=6, messages=HELLO, extra_body=GREEDY, system="You are terse.")
    assert msg.id.startswith("msg_") and msg.type == "message" and msg.role == "assistant" and msg.model == MODEL
    assert len(msg.content) == 1 and msg.content[0].type == "text"
    assert 1 <= msg.usage.output_tokens <= 6
    assert msg.stop_reason == ("max_tokens" if msg.usage.output_tokens == 6 else "end_turn") and msg.stop_sequence is None
    blocks = client.messages.create(
        model="default", max_tokens=6, messages=HELLO, system=[{"type": "text", "text": "You are terse."}],
        metadata={"user_id": "u-1"}, extra_body={"temperature": 0, "top_k": 5, "top_p": 0.9},
    )
    assert blocks.content[0].text == msg.content[0].text  # greedy; system as blocks renders the same


def test_usage_counts_and_cache_reads(client: anthropic.Anthropic, server: ServeProcess) -> None:
    system = "You are a careful assistant. Answer in one short sentence, and never use lists or tables."
    count = client.messages.count_tokens(model=MODEL, messages=HELLO, system=system).input_tokens
    assert count == tokenize(server, [{"role": "system", "content": system}, *HELLO])["count"] > 20
    first = client.messages.create(model=MODEL, max_tokens=2, messages=HELLO, system=system, extra_body=GREEDY)
    second = client.messages.create(model=MODEL, max_tokens=2, messages=HELLO, system=system, extra_body=GREEDY)
    for msg in (first, second):
        assert msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0) == count
    assert second.usage.cache_read_input_tokens is not None and second.usage.cache_read_input_tokens > 0


def test_stop_sequence(client: anthropic.Anthropic) -> None:
    full = client.messages.create(model=MODEL, max_tokens=16, messages=HELLO, extra_body=GREEDY).content[0].text
    assert len(full) >= 8, full
    stop = full[4:7]
    cut = client.messages.create(model=MODEL, max_tokens=16, messages=HELLO, extra_body=GREEDY, stop_sequences=[stop])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == full[: full.index(stop)]


def test_stream_with_the_client(client: anthropic.Anthropic) -> None:
    whole = client.messages.create(model=MODEL, max_tokens=8, messages=HELLO, extra_body=GREEDY)
    with client.messages.stream(model=MODEL, max_tokens=8, messages=HELLO, extra_body=GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text == final.content[0].text
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens


def test_stream_event_order(server: ServeProcess) -> None:
    body = {"model": MODEL, "max_tokens": 6, "messages": HELLO, "temperature": 0, "stream": True}
    headers = {"x-api-key": API_KEY, "anthropic-version": "2023-06-01"}
    events: list[tuple[str, dict[str, Any]]] = []
    with httpx.stream("POST", f"{server.base}/v1/messages", json=body, headers=headers, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        name = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data = json.loads(line[6:])
                assert name == data["type"]
                events.append((name, data))
    names = [n for n, _ in events]
    deltas = names.count("content_block_delta")
    assert deltas >= 1
    assert names == ["message_start", "content_block_start", "ping", *["content_block_delta"] * deltas,
                     "content_block_stop", "message_delta", "message_stop"]
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["output_tokens"] == 0
    end = events[-2][1]
    assert end["delta"]["stop_reason"] in ("end_turn", "max_tokens") and 1 <= end["usage"]["output_tokens"] <= 6


def test_tool_use_history_round_trip(client: anthropic.Anthropic, server: ServeProcess, tiny_gemma_dir: Any) -> None:
    """A tool_use turn and its tool_result fed back render exactly as the chat route renders the
    same OpenAI messages (this ChatML template knows no tool calls, so the call is written in the
    Hermes format the model is asked to use) and the reply is a valid message."""
    system = "You are a weather bot."
    count = client.messages.count_tokens(model=MODEL, messages=TOOL_TURNS, system=system).input_tokens
    with server.http() as c:
        chat = c.post("/v1/chat/completions", json={"model": MODEL, "messages": TOOL_TURNS_AS_CHAT, "max_tokens": 1})
    assert chat.status_code == 200 and count == chat.json()["usage"]["prompt_tokens"]
    tok = Tokenizer.from_pretrained_dir(tiny_gemma_dir)
    messages, _ = prepare_messages(tok, TOOL_TURNS_AS_CHAT, [], make_tool_parser("hermes", None), parallel=True)
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>' in prompt
    assert "18 C, sunny" in prompt and "Thanks!" in prompt and len(tok.encode(prompt, add_special_tokens=False)) == count
    reply = client.messages.create(model=MODEL, max_tokens=5, messages=TOOL_TURNS, system=system, extra_body=GREEDY)
    assert reply.type == "message" and reply.content[0].type == "text" and reply.stop_reason in ("end_turn", "max_tokens")
    assert reply.usage.input_tokens + (reply.usage.cache_read_input_tokens or 0) == count
    with client.messages.stream(model=MODEL, max_tokens=5, messages=TOOL_TURNS, system=system, extra_body=GREEDY) as stream:
        assert stream.get_final_message().content[0].text == reply.content[0].text


CITIES = ["Paris", "Oslo", "Lima"]
CITY_SCHEMA: Any = {"type": "object", "properties": {"city": {"type": "string", "enum": CITIES}}, "required": ["city"],
                    "additionalProperties": False}
TOOLS: Any = [
    {"name": "get_weather", "description": "Current weather of a city", "input_schema": CITY_SCHEMA},
    {"name": "get_time", "description": "Local time of a city", "input_schema": CITY_SCHEMA},
]
ASK: Any = [{"role": "user", "content": "What is the weather in Paris?"}]


def check_tool_use(block: Any, name: str | None = None) -> None:
    assert block.type == "tool_use" and block.id.startswith("toolu_")
    assert block.name in ("get_weather", "get_time") and (name is None or block.name == name)
    jsonschema.validate(block.input, CITY_SCHEMA)


def test_forced_tool_use_round_trip(client: anthropic.Anthropic, server: ServeProcess) -> None:
    """`tool_choice: tool` makes even the random model call that tool (the grammar); the call and
    its `tool_result` go back and the model answers; the tools are in the prompt count_tokens sees."""
    bare = client.messages.count_tokens(model=MODEL, messages=ASK).input_tokens
    with_tools = client.messages.count_tokens(model=MODEL, messages=ASK, tools=TOOLS).input_tokens
    assert with_tools > bare + 40
    msg = client.messages.create(
        model=MODEL, max_tokens=120, messages=ASK, tools=TOOLS, tool_choice={"type": "tool", "name": "get_time"}, extra_body={"temperature": 1},
    )
    assert msg.stop_reason == "tool_use" and msg.stop_sequence is None, msg
    assert [b.type for b in msg.content] == ["tool_use"], msg.content
    check_tool_use(msg.content[0], "get_time")
    assert msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0) == with_tools
    call = msg.content[0]
    messages: Any = [
        *ASK,
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in msg.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": json.dumps({"time": "12:00"})}]},
    ]
    answer = client.messages.create(model=MODEL, max_tokens=8, messages=messages, tools=TOOLS, extra_body=GREEDY)  # auto
    assert answer.type == "message" and answer.content
    assert answer.stop_reason in ("end_turn", "max_tokens", "tool_use")
    for block in answer.content:
        if block.type == "tool_use":
            check_tool_use(block)
        else:
            assert block.type == "text"
    assert (answer.stop_reason == "tool_use") == any(b.type == "tool_use" for b in answer.content)
    server.assert_balanced_idle()


def test_tool_use_streamed_in_anthropic_order(client: anthropic.Anthropic) -> None:
    """`tool_choice: any` streamed: one tool_use block opened, its arguments as input_json_delta
    (accumulating to valid input), closed, then `stop_reason: tool_use`."""
    events: list[Any] = []
    with client.messages.stream(
        model=MODEL, max_tokens=120, messages=ASK, tools=TOOLS, tool_choice={"type": "any"}, extra_body={"temperature": 1},
    ) as stream:
        for ev in stream:
            if ev.type in ("message_start", "content_block_start", "content_block_delta", "content_block_stop", "message_delta", "message_stop"):
                events.append(ev)
        final = stream.get_final_message()
    names = [ev.type for ev in events]
    deltas = names.count("content_block_delta")
    assert names == ["message_start", "content_block_start", *["content_block_delta"] * deltas, "content_block_stop",
                     "message_delta", "message_stop"], names
    start = events[1].content_block
    assert events[1].index == 0 and start.type == "tool_use" and start.id.startswith("toolu_") and start.input == {}
    partial = "".join(ev.delta.partial_json for ev in events if ev.type == "content_block_delta")
    assert {ev.delta.type for ev in events if ev.type == "content_block_delta"} == {"input_json_delta"}
    jsonschema.validate(json.loads(partial), CITY_SCHEMA)
    assert events[-2].delta.stop_reason == "tool_use" and final.stop_reason == "tool_use"
    assert len(final.content) == 1
    check_tool_use(final.content[0])
    assert final.content[0].input == json.loads(partial) and final.content[0].id == start.id


def test_tool_choice_none_gives_text(client: anthropic.Anthropic, server: ServeProcess) -> None:
    """`none`: the tools stay out of the prompt and the reply is text, streamed and not."""
    bare = client.messages.count_tokens(model=MODEL, messages=ASK).input_tokens
    assert client.messages.count_tokens(model=MODEL, messages=ASK, tools=TOOLS, tool_choice={"type": "none"}).input_tokens == bare
    msg = client.messages.create(model=MODEL, max_tokens=6, messages=ASK, tools=TOOLS, tool_choice={"type": "none"}, extra_body=GREEDY)
    assert [b.type for b in msg.content] == ["text"] and msg.stop_reason in ("end_turn", "max_tokens")
    plain = client.messages.create(model=MODEL, max_tokens=6, messages=ASK, extra_body=GREEDY)
    assert msg.content[0].text == plain.content[0].text
    body = {"model": MODEL, "max_tokens": 6, "messages": ASK, "tools": TOOLS, "tool_choice": {"type": "none"}, "temperature": 0, "stream": True}
    headers = {"x-api-key": API_KEY, "anthropic-version": "2023-06-01"}
    names, text = [], ""
    with httpx.stream("POST", f"{server.base}/v1/messages", json=body, headers=headers, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                data = json.loads(line[6:])
                names.append(data["type"])
                text += data.get("delta", {}).get("text", "")
    assert names[:3] == ["message_start", "content_block_start", "ping"] and names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert text == plain.content[0].text


def test_errors_raise_the_client_types(client: anthropic.Anthropic, server: ServeProcess) -> None:
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(model=MODEL, max_tokens=0, messages=HELLO)
    assert bad.value.status_code == 400 and bad.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    assert "max_tokens" in bad.value.body["error"]["message"]  # type: ignore[index]
    with pytest.raises(anthropic.NotFoundError) as missing:
        client.messages.create(model="claude-no-such-model", max_tokens=4, messages=HELLO)
    assert missing.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    wrong = anthropic.Anthropic(base_url=server.base, api_key="wrong-key", max_retries=0, timeout=60)
    with pytest.raises(anthropic.AuthenticationError) as denied:
        wrong.messages.create(model=MODEL, max_tokens=4, messages=HELLO)
    assert denied.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
    with pytest.raises(anthropic.BadRequestError) as tools:
        client.messages.create(model=MODEL, max_tokens=4, messages=HELLO, tools=[{"type": "web_search_20250305", "name": "web_search"}])
    assert "tools[0].type" in tools.value.body["error"]["message"]  # type: ignore[index]
    with pytest.raises(anthropic.BadRequestError) as long:
        client.messages.create(model=MODEL, max_tokens=100_000, messages=HELLO)
    assert "context length" in long.value.body["error"]["message"]  # type: ignore[index]
    with pytest.raises(anthropic.BadRequestError):
        client.messages.count_tokens(model=MODEL, messages=[])


@pytest.mark.parametrize(
    ("body", "names"),
    [
        ({"model": MODEL, "messages": HELLO}, "max_tokens"),
        ({"model": MODEL, "max_tokens": 4, "messages": HELLO, "metadata": {"user_id": "u", "tier": "gold"}}, "metadata.tier"),
        ({"model": MODEL, "max_tokens": 4, "messages": HELLO, "temperature": 1.5}, "temperature"),
        ({"model": MODEL, "max_tokens": 4, "messages": HELLO, "top_p": 0}, "top_p"),
        ({"model": MODEL, "max_tokens": 4, "messages": HELLO, "stop_sequences": "x"}, "stop_sequences"),
        ({"model": MODEL, "max_tokens": 4, "messages": HELLO, "frequency_penalty": 1}, "frequency_penalty"),
        ({"model": MODEL, "max_tokens": 4, "messages": HELLO, "tool_choice": {"type": "any"}}, "tool_choice"),
        ({"model": MODEL, "max_tokens": 4, "messages": HELLO, "tools": [{"name": "bad name!", "input_schema": {}}]}, "tools[0].name"),
        ({"model": MODEL, "max_tokens": 4, "messages": HELLO, "tools": [{"name": "f", "input_schema": 3}]}, "tools[0].input_schema"),
        ({"model": MODEL, "max_tokens": 4, "messages": HELLO, "tools": [{"name": "f"}], "tool_choice": {"type": "tool", "name": "g"}},
         "tool_choice"),
        ({"model": MODEL, "max_tokens": 4, "messages": HELLO, "tools": [{"name": "f"}], "tool_choice": {"type": "sometimes"}},
         "tool_choice.type"),
        ({"model": MODEL, "max_tokens": 4, "messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ({"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}]}]}, "messages[0].content[0]"),
        ({"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [
            {"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]}, "messages[0].content[0]"),
    ],
)
def test_bad_requests_in_anthropic_shape(server: ServeProcess, body: dict[str, Any], names: str) -> None:
    with server.http() as c:  # Authorization: Bearer, as the OpenAI routes take it
        r = c.post("/v1/messages", json=body, headers={"anthropic-version": "2023-06-01"})
    assert r.status_code == 400, r.text
    doc = r.json()
    assert doc["type"] == "error" and doc["error"]["type"] == "invalid_request_error", doc
    assert names in doc["error"]["message"], doc
    assert doc["request_id"] == r.headers["x-request-id"]


def test_openai_routes_keep_openai_errors(server: ServeProcess) -> None:
    with server.http() as c:
        r = c.post("/v1/chat/completions", json={"model": MODEL, "messages": HELLO, "max_tokens": 0})
    assert r.status_code == 400 and set(r.json()) == {"error"} and r.json()["error"]["param"] == "max_tokens"


def test_idle_balanced_after_anthropic_traffic(server: ServeProcess) -> None:
    server.assert_balanced_idle()
