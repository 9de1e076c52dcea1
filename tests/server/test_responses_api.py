"""`/v1/responses` over real HTTP on the tiny sliding-window model (ChatML template, Hermes tool
calls): bodies and every stream event validated against the `openai` SDK's published types, the
event order and sequence numbers, `previous_response_id` chaining with cached tokens for the whole
earlier conversation, forced function calls, `text.format`, hosted tools left out, the store
(GET / DELETE / 404s) and the 400s that name the exact key; and, without a server, the store's LRU
and TTL and the output items' order."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter
from serving import ServeProcess

from freetoken.server.core.generation import Clock, Piece
from freetoken.server.core.streaming import Tally
from freetoken.server.core.tool_calling import ToolStream
from freetoken.server.operations.activity import Activity
from freetoken.server.operations.metrics import Metrics
from freetoken.server.process.client import EngineUnavailable
from freetoken.server.responses.items import items_to_messages
from freetoken.server.responses.output import OutputItems, response_body, usage
from freetoken.server.responses.store import ResponseStore, StoredResponse
from freetoken.server.responses.stream import collected_items, response_events
from freetoken.tokenizer.reasoning import reasoning_stream
from freetoken.tokenizer.tool_parsers import StreamDelta, ToolCall, ToolCallDelta, make_tool_parser

MODEL = "tiny-gemma"
PAGE = 4  # the shared server's --page-size
EVENT = TypeAdapter(ResponseStreamEvent)
CITIES = ["Paris", "Oslo", "Lima"]
WEATHER = {
    "type": "function", "name": "get_weather", "description": "Current weather of a city", "strict": True,
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": CITIES}},
                   "required": ["city"], "additionalProperties": False},
}


def post(server: ServeProcess, body: dict[str, Any]) -> httpx.Response:
    with server.http() as c:
        return c.post("/v1/responses", json={"model": MODEL, **body})


def create(server: ServeProcess, **body: Any) -> dict[str, Any]:
    r = post(server, body)
    assert r.status_code == 200, r.text
    Response.model_validate(r.json())  # the SDK's own model of a response
    return r.json()


def stream(server: ServeProcess, **body: Any) -> tuple[list[dict[str, Any]], httpx.Headers]:
    """Every event of a streamed response, each checked against the SDK's event union and its `event:` line."""
    events: list[dict[str, Any]] = []
    with server.http() as c, c.stream("POST", "/v1/responses", json={"model": MODEL, "stream": True, **body}) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        name = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                assert line != "data: [DONE]"
                event = json.loads(line[6:])
                assert event["type"] == name
                EVENT.validate_python(event)
                events.append(event)
        return events, r.headers


def message_text(body: dict[str, Any]) -> str:
    return "".join(p["text"] for item in body["output"] if item["type"] == "message" for p in item["content"])


def test_string_input_gives_a_response_object(server: ServeProcess) -> None:
    body = create(server, input="Say hello.", max_output_tokens=6, temperature=0)
    assert body["object"] == "response" and body["id"].startswith("resp_")
    assert body["status"] in ("completed", "incomplete") and body["model"] == MODEL
    [item] = body["output"]
    assert item["type"] == "message" and item["role"] == "assistant"
    usage = body["usage"]
    assert usage["output_tokens"] >= 1 and usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    if body["status"] == "incomplete":
        assert usage["output_tokens"] == 6 and body["incomplete_details"] == {"reason": "max_output_tokens"}
        assert item["status"] == "incomplete"
    # The same request again is served from the prefix cache, and its usage says how much: whole
    # pages, never the whole prompt (at least one token is always computed).
    again = create(server, input="Say hello.", max_output_tokens=6, temperature=0)["usage"]
    cached = again["input_tokens_details"]["cached_tokens"]
    assert again["input_tokens"] == usage["input_tokens"]
    assert cached % PAGE == 0 and 0 < cached < usage["input_tokens"], again
    server.assert_balanced_idle()


def test_stream_follows_the_published_event_sequence(server: ServeProcess) -> None:
    events, _ = stream(server, input=[{"role": "user", "content": [{"type": "input_text", "text": "Tell me a story."}]}],
                       max_output_tokens=12, temperature=1.0, seed=7)
    types = [e["type"] for e in events]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert types[:6] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", *types[4:6]]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done", types[-1]]
    assert set(types[4:-4]) <= {"response.output_text.delta"}
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    final = events[-1]["response"]
    assert types[-1] == ("response.incomplete" if final["status"] == "incomplete" else "response.completed")
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert deltas == events[-4]["text"] == message_text(final)
    item_id = events[2]["item"]["id"]
    assert all(e["item_id"] == item_id for e in events[3:-2]) and events[-2]["item"]["id"] == item_id
    assert final["usage"]["output_tokens"] >= 1
    with server.http() as c:  # a streamed response is stored like any other
        assert c.get(f"/v1/responses/{final['id']}").json() == final
    server.assert_balanced_idle()


def test_stream_and_body_agree(server: ServeProcess) -> None:
    request = {"input": "Count to five.", "max_output_tokens": 10, "temperature": 1.0, "seed": 11}
    body = create(server, **request)
    events, _ = stream(server, **request)
    assert message_text(events[-1]["response"]) == message_text(body)
    assert events[-1]["response"]["usage"]["output_tokens"] == body["usage"]["output_tokens"]


def test_chained_request_hits_the_cache_for_the_whole_earlier_conversation(server: ServeProcess) -> None:
    first = create(server, instructions="You are terse.", input="A long enough first question about cities and rivers.",
                   max_output_tokens=10, temperature=1.0, seed=3)
    second = create(server, instructions="You are terse.", previous_response_id=first["id"], input="And the second one?",
                    max_output_tokens=4, temperature=1.0, seed=4)
    earlier = first["usage"]["input_tokens"] + first["usage"]["output_tokens"]
    assert second["usage"]["input_tokens"] > earlier
    # the engine keeps prompt + output - 1 tokens; hits are whole pages
    assert second["usage"]["input_tokens_details"]["cached_tokens"] >= (earlier - 1) // PAGE * PAGE
    assert second["previous_response_id"] == first["id"]
    third = create(server, instructions="You are terse.", previous_response_id=second["id"], input="Third.", max_output_tokens=2)
    earlier = second["usage"]["input_tokens"] + second["usage"]["output_tokens"]
    assert third["usage"]["input_tokens_details"]["cached_tokens"] >= (earlier - 1) // PAGE * PAGE
    server.assert_balanced_idle()


def test_forced_function_call_and_its_result_chained(server: ServeProcess) -> None:
    body = create(server, input="Weather in Paris?", tools=[WEATHER], tool_choice="required", max_output_tokens=120, seed=1)
    calls = [item for item in body["output"] if item["type"] == "function_call"]
    assert len(calls) == 1 and calls[0]["name"] == "get_weather" and calls[0]["call_id"].startswith("call_")
    assert json.loads(calls[0]["arguments"])["city"] in CITIES and body["status"] == "completed"
    answer = create(server, previous_response_id=body["id"], tools=[WEATHER], max_output_tokens=4,
                    input=[{"type": "function_call_output", "call_id": calls[0]["call_id"], "output": '{"temp_c": 18}'}])
    assert answer["status"] in ("completed", "incomplete")
    assert answer["usage"]["input_tokens_details"]["cached_tokens"] >= body["usage"]["input_tokens"] // PAGE * PAGE - PAGE
    server.assert_balanced_idle()


def test_streamed_function_call_events(server: ServeProcess) -> None:
    events, _ = stream(server, input="Weather in Oslo?", tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"},
                       max_output_tokens=120, seed=2)
    added = [e for e in events if e["type"] == "response.output_item.added" and e["item"]["type"] == "function_call"]
    assert len(added) == 1 and added[0]["item"]["arguments"] == ""
    item_id = added[0]["item"]["id"]
    pieces = [e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta" and e["item_id"] == item_id]
    [done] = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    assert "".join(pieces) == done["arguments"] and json.loads(done["arguments"])["city"] in CITIES
    assert len(pieces) > 1  # Hermes arguments go out while the model writes them
    final = events[-1]["response"]
    assert events[-1]["type"] == "response.completed"
    [call] = [item for item in final["output"] if item["type"] == "function_call"]
    assert call["arguments"] == done["arguments"] and call["status"] == "completed"


def test_forced_call_cut_off_stays_a_call(server: ServeProcess) -> None:
    request = {"input": "Weather?", "tools": [WEATHER], "tool_choice": "required", "max_output_tokens": 3}
    body = create(server, **request)
    events, _ = stream(server, **request)
    for final in (body, events[-1]["response"]):
        assert final["status"] == "incomplete" and final["incomplete_details"] == {"reason": "max_output_tokens"}
        [call] = final["output"]
        assert call["type"] == "function_call" and call["name"] == "get_weather" and call["status"] == "incomplete"
    assert events[-1]["type"] == "response.incomplete"


def test_text_format_json_schema_goes_through_the_grammar(server: ServeProcess) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string", "enum": CITIES}}, "required": ["city"], "additionalProperties": False}
    body = create(server, input="Pick a city.", max_output_tokens=60, seed=5,
                  text={"format": {"type": "json_schema", "name": "pick", "schema": schema, "strict": True}})
    assert json.loads(message_text(body))["city"] in CITIES
    assert body["text"]["format"]["name"] == "pick"


def test_hosted_tools_are_left_out_and_named_in_a_header(server: ServeProcess) -> None:
    tools = [{"type": "web_search"}, {"type": "namespace", "name": "mcp", "description": "d", "tools": []}, WEATHER, {"type": "web_search"}]
    r = post(server, {"input": "hi", "tools": tools, "max_output_tokens": 2})
    assert r.status_code == 200, r.text
    assert r.headers["x-freetoken-ignored-tools"] == "web_search,namespace"
    assert [t["name"] for t in r.json()["tools"]] == ["get_weather"]
    _, headers = stream(server, input="hi", tools=tools, max_output_tokens=2)
    assert headers["x-freetoken-ignored-tools"] == "web_search,namespace"


CODEX_INPUT: Any = [
    {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Be careful."}]},
    {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "List files."}]},
    {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "opaque"},
    {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Lima"}'},
    {"type": "function_call_output", "call_id": "call_1", "output": [{"type": "input_text", "text": "sunny"}]},
    {"type": "local_shell_call", "id": "ls_1", "call_id": "c2", "status": "completed", "action": {"type": "exec", "command": ["ls"], "env": {}}},
    {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Done.", "annotations": []}]},
    {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Now the weather in Oslo."}]},
]


def test_a_codex_turn_streams(server: ServeProcess) -> None:
    """What Codex sends each turn: the whole history, store false, hosted tools, streamed."""
    events, headers = stream(
        server, instructions="You are a coding agent.", input=CODEX_INPUT, store=False, parallel_tool_calls=False,
        tools=[WEATHER, {"type": "local_shell"}, {"type": "web_search"}], tool_choice="auto", include=["reasoning.encrypted_content"],
        reasoning={"effort": "medium", "summary": "auto"}, prompt_cache_key="conv-1", max_output_tokens=6,
    )
    assert headers["x-freetoken-ignored-tools"] == "local_shell,web_search"
    assert events[-1]["type"] in ("response.completed", "response.incomplete") and events[-1]["response"]["store"] is False
    server.assert_balanced_idle()


def test_fields_codex_and_the_sdks_send_are_accepted(server: ServeProcess) -> None:
    body = create(
        server,
        instructions="You are a coding agent.",
        input=CODEX_INPUT,
        tools=[WEATHER], tool_choice="auto", parallel_tool_calls=False, store=False, stream=False,
        include=["reasoning.encrypted_content"], reasoning={"effort": "medium", "summary": "auto"}, prompt_cache_key="k1",
        client_metadata={"x": 1}, service_tier="auto", safety_identifier="u1", text={"verbosity": "low"}, truncation="disabled",
        metadata={"run": "1"}, user="me", max_output_tokens=3, top_logprobs=0, context_management=[], prompt_cache_retention="in_memory",
    )
    assert body["store"] is False and body["metadata"] == {"run": "1"} and body["parallel_tool_calls"] is False
    with server.http() as c:
        assert c.get(f"/v1/responses/{body['id']}").status_code == 404  # store: false keeps nothing


def test_get_and_delete(server: ServeProcess) -> None:
    body = create(server, input="hi", max_output_tokens=2)
    with server.http() as c:
        got = c.get(f"/v1/responses/{body['id']}")
        assert got.status_code == 200 and got.json() == body
        gone = c.delete(f"/v1/responses/{body['id']}")
        assert gone.json() == {"id": body["id"], "object": "response.deleted", "deleted": True}
        for r in (c.get(f"/v1/responses/{body['id']}"), c.delete(f"/v1/responses/{body['id']}")):
            assert r.status_code == 404
            assert r.json()["error"]["param"] == "response_id" and r.json()["error"]["type"] == "invalid_request_error"
    r = post(server, {"input": "hi", "previous_response_id": body["id"]})
    assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id"


def test_input_items_are_listed(server: ServeProcess) -> None:
    body = create(server, max_output_tokens=2, input=[
        {"role": "user", "content": "one"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "two", "annotations": []}]},
        {"role": "user", "content": "three"},
    ])
    url = f"/v1/responses/{body['id']}/input_items"
    with server.http() as c:
        newest = c.get(url).json()
        assert newest["object"] == "list" and not newest["has_more"]
        assert [item["content"][0]["text"] for item in newest["data"]] == ["three", "two", "one"]
        assert newest["data"][0]["content"][0]["type"] == "input_text" and newest["data"][1]["content"][0]["type"] == "output_text"
        first = c.get(url, params={"order": "asc", "limit": 2}).json()
        assert [i["id"] for i in first["data"]] == [i["id"] for i in reversed(newest["data"])][:2] and first["has_more"]
        rest = c.get(url, params={"order": "asc", "after": first["last_id"]}).json()
        assert [i["content"][0]["text"] for i in rest["data"]] == ["three"] and not rest["has_more"]
        for params, param in (({"limit": 0}, "limit"), ({"order": "up"}, "order"), ({"after": "msg_x"}, "after")):
            r = c.get(url, params=params)
            assert r.status_code == 400 and r.json()["error"]["param"] == param
        assert c.get("/v1/responses/resp_missing/input_items").status_code == 404


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0].type"),
        ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role"),
        ({"input": ["hi"]}, "input[0]"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input[0].arguments"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
        ({"input": [{"type": "teleport"}]}, "input[0].type"),
        ({"input": []}, "input"),
        ({"input": "hi", "tools": [{**WEATHER, "name": "bad name!"}]}, "tools[0].name"),
        ({"input": "hi", "tools": [{**WEATHER, "colour": "red"}]}, "tools[0].colour"),
        ({"input": "hi", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice.name"),
        ({"input": "hi", "tool_choice": "required"}, "tool_choice"),
        ({"input": "hi", "tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
        ({"input": "hi", "text": {"format": {"type": "yaml"}}}, "text.format.type"),
        ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
        ({"input": "hi", "text": {"tone": "dry"}}, "text.tone"),
        ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "hi", "temperature": -1}, "temperature"),
        ({"input": "hi", "background": True}, "background"),
        ({"input": "hi", "conversation": "conv_1"}, "conversation"),
        ({"input": "hi", "frobnicate": 1}, "frobnicate"),
        ({"input": "hi", "max_output_tokens": 100000}, "max_output_tokens"),
    ],
)
def test_bad_requests_name_the_key(server: ServeProcess, body: dict[str, Any], param: str) -> None:
    r = post(server, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error


def _entry(tag: str) -> StoredResponse:
    from array import array

    return StoredResponse({"id": tag}, (), "", array("i"), array("i"), (), plain_output=True)


def test_store_is_lru_bounded_and_ages_out() -> None:
    now = [0.0]
    store = ResponseStore(max_entries=2, ttl_s=10.0, clock=lambda: now[0])
    store.put("a", _entry("a"))
    store.put("b", _entry("b"))
    assert store.get("a") is not None  # a is now the most recent
    store.put("c", _entry("c"))
    assert store.get("b") is None and len(store) == 2
    now[0] = 5.0
    store.put("d", _entry("d"))  # evicts a: c was stored after a was last read
    assert {k for k in "acd" if store.get(k) is not None} == {"c", "d"}
    now[0] = 10.0  # c (stored at 0) is 10 s old: gone; d stays
    assert store.get("c") is None and store.get("d") is not None
    assert store.delete("d") and not store.delete("d") and len(store) == 0


def test_output_items_hold_whitespace_and_keep_the_written_order() -> None:
    items = OutputItems()
    call = ToolCall("call_1", "f", "{}")
    events = items.feed(StreamDelta(content="\n "))
    assert events == []
    events = items.feed(StreamDelta(reasoning="hmm", tool_calls=[ToolCallDelta(0, call)]))
    events += items.finish(incomplete=False)
    assert [i["type"] for i in items.items] == ["reasoning", "function_call"]
    assert items.items[0]["content"] == [{"type": "reasoning_text", "text": "hmm"}]
    for event in events:
        EVENT.validate_python({**event, "sequence_number": 0})
    split = OutputItems()  # a parser that streams arguments: fragments of one call, then text
    events = split.feed(StreamDelta(tool_calls=[ToolCallDelta(0, ToolCall("call_2", "f", '{"a"'))]))
    events += split.feed(StreamDelta(content=" ", tool_calls=[ToolCallDelta(0, ToolCall("call_2", "f", ": 1}"), first=False)]))
    events += split.feed(StreamDelta(content="ok"))
    events += split.finish(incomplete=False)
    assert [(i["type"], i.get("arguments")) for i in split.items] == [("function_call", '{"a": 1}'), ("message", None)]
    assert split.items[1]["content"][0]["text"] == " ok"
    types = [e["type"] for e in events]
    assert types.count("response.function_call_arguments.delta") == 2
    assert types.index("response.function_call_arguments.done") < types.index("response.output_text.delta")
    only_space = OutputItems()
    only_space.feed(StreamDelta(content="  "))
    only_space.finish(incomplete=True)
    assert only_space.items[0]["content"][0]["text"] == "  " and only_space.items[0]["status"] == "incomplete"


def test_a_failure_mid_stream_is_an_error_event_then_response_failed() -> None:
    async def rest() -> AsyncIterator[Piece]:
        yield Piece(0, text=" world", token_ids=[5])
        raise EngineUnavailable("the engine process exited")

    stored: list[Any] = []
    ctx: Any = SimpleNamespace(client=SimpleNamespace(state="down"), metrics=Metrics(), activity=Activity())

    def body(status: str, output: list[dict[str, Any]], usage_doc: dict[str, Any] | None) -> dict[str, Any]:
        return response_body("resp_1", 0, MODEL, {"tools": [], "tool_choice": "auto", "parallel_tool_calls": True}, status=status,
                             output=output, usage_doc=usage_doc)

    async def run() -> list[str]:
        events = response_events(
            ctx, "responses", rest(), Piece(0, text="Hello", token_ids=[4]), tally=Tally([3], [0]), clock=Clock(),
            parser=ToolStream(None, True), body=body, usage_of=lambda t: usage(t.prompt_tokens, t.completion_tokens, 0),
            on_done=lambda final, ids: stored.append(final),
        )
        return [frame async for frame in events]

    frames = asyncio.run(run())
    events = [json.loads(f.split("data: ", 1)[1]) for f in frames]
    for event in events:
        EVENT.validate_python(event)
    assert [e["type"] for e in events][-3:] == ["response.output_text.delta", "error", "response.failed"]
    assert events[-2]["code"] == "engine_unavailable" and "engine process exited" in events[-2]["message"]
    assert events[-1]["response"]["status"] == "failed" and events[-1]["response"]["error"]["code"] == "server_error"
    assert stored == []  # a failed response is not stored
    assert ctx.metrics.requests.labels(endpoint="responses", status="503")._value.get() == 1


def test_items_become_chat_messages() -> None:
    conversation = items_to_messages(CODEX_INPUT)
    assert conversation.messages == [
        {"role": "system", "content": "Be careful."},
        {"role": "user", "content": "List files."},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Lima"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny", "name": "get_weather"},
        {"role": "assistant", "content": "Done."},
        {"role": "user", "content": "Now the weather in Oslo."},
    ]
    assert conversation.dropped == ["local_shell_call"]
    earlier = items_to_messages([{"type": "function_call_output", "call_id": "call_9", "output": "x"}], names={"call_9": "f"})
    assert earlier.messages == [{"role": "tool", "tool_call_id": "call_9", "content": "x", "name": "f"}]


def _tooling(tokenizer: Any) -> Any:
    from freetoken.server.settings import ServerConfig
    from freetoken.server.core.tool_calling import ToolCalling, ToolOptions

    ctx: Any = SimpleNamespace(tokenizer=tokenizer, config=ServerConfig(), client=SimpleNamespace(info=None))
    return ToolCalling(ctx, ToolOptions())


@pytest.mark.parametrize("template", ["chatml", "gemma3"])
def test_a_chained_prompt_reuses_the_sampled_ids(tmp_path: Any, template: str) -> None:
    """The earlier output was sampled as single bytes (not how the tokenizer would spell it), with
    a trailing newline Gemma's template trims. The chained prompt still starts with the earlier
    prompt's ids and exactly the sampled ids, then the template's text after the output."""
    from array import array

    from freetoken.server.responses.prompt import build_prompt
    from freetoken.tokenizer import Tokenizer
    from freetoken.families.gemma3 import CHAT_TEMPLATE as GEMMA3_CHAT_TEMPLATE
    from freetoken.tokenizer.testing import write_tiny_tokenizer

    tokenizer = Tokenizer.from_pretrained_dir(write_tiny_tokenizer(tmp_path))
    if template == "gemma3":
        tokenizer = Tokenizer(tokenizer.backend, bos_id=None, eos_id=2, chat_template=GEMMA3_CHAT_TEMPLATE)
    tooling = _tooling(tokenizer)
    user = {"role": "user", "content": "Name a river."}
    first = build_prompt(tokenizer, tooling, [user], None)
    text = "the Seine\n"
    end = [2] if template == "chatml" else []  # ChatML's <|im_end|> is the model's end of turn; Gemma's here a length cut
    sampled = [3 + b for b in text.encode()] + end  # ids 3..258 are the 256 bytes
    assert sampled[: len(text)] != tokenizer.encode(text, add_special_tokens=False)  # re-tokenizing would not give them back
    prior = StoredResponse({}, (user, {"role": "assistant", "content": text}), first.text, array("i", first.ids), array("i", sampled),
                           first.boundaries, plain_output=True)
    messages = [*prior.messages, {"role": "user", "content": "Another?"}]
    chained = build_prompt(tokenizer, tooling, messages, prior, output_at=1)
    assert chained.ids[: len(first.ids) + len(sampled)] == first.ids + sampled
    rest = tokenizer.decode(chained.ids[len(first.ids) + len(sampled):], skip_special_tokens=False)
    assert chained.text.endswith(rest) and "Another?" in rest
    assert len(first.ids) + len(sampled) in chained.boundaries


def test_reasoning_sealed_for_the_client_comes_back_when_replayed() -> None:
    """include: ["reasoning.encrypted_content"] with store: false (Codex): the reasoning item
    carries its text as an opaque token, and replaying the item (content dropped, as Codex sends
    it) restores the text as the assistant's reasoning_content."""
    items = OutputItems(seal_reasoning=True)
    events = items.feed(StreamDelta(reasoning="Paris is in France, é.", content="It is Paris."))
    events += items.finish(incomplete=False)
    reasoning, message = items.items
    token = reasoning["encrypted_content"]
    assert token.startswith("ft1.") and "Paris" not in token
    done = [e for e in events if e["type"] == "response.output_item.done"]
    assert done[0]["item"]["encrypted_content"] == token
    Response.model_validate(response_body("resp_1", 0, "m", {"tools": [], "parallel_tool_calls": True, "tool_choice": "auto"},
                                          status="completed", output=items.items, usage_doc=usage(3, 4, 0)))
    replay = [
        {"role": "user", "content": "Capital?"},
        {"type": "reasoning", "id": reasoning["id"], "summary": [], "encrypted_content": token},
        {**message},
        {"role": "user", "content": "Sure?"},
    ]
    messages = items_to_messages(replay).messages
    assert messages[1] == {"role": "assistant", "content": "It is Paris.", "reasoning_content": "Paris is in France, é."}
    plain = OutputItems()
    plain.feed(StreamDelta(reasoning="r"))
    plain.finish(incomplete=False)
    assert plain.items[0]["encrypted_content"] is None
    foreign = [{"type": "reasoning", "summary": [], "encrypted_content": "gAAAAABopenai"}, {"role": "assistant", "content": "a"}]
    assert items_to_messages(foreign).messages == [{"role": "assistant", "content": "a"}]
    with pytest.raises(Exception) as err:
        items_to_messages([{"type": "reasoning", "summary": [], "encrypted_content": "ft1.%%%"}, {"role": "assistant", "content": "a"}])
    assert getattr(err.value, "param", None) == "input[0].encrypted_content"


def test_output_text_logprobs(server: ServeProcess) -> None:
    """include: ["message.output_text.logprobs"] + top_logprobs: one entry per output token, the
    same streamed (delta by delta) as not, each with its top alternatives."""
    ask: dict[str, Any] = {"input": "Count: one two", "max_output_tokens": 6, "temperature": 0.0, "top_logprobs": 2,
                           "include": ["message.output_text.logprobs"]}
    body = create(server, **ask)
    [message] = body["output"]
    logprobs = message["content"][0]["logprobs"]
    assert len(logprobs) == body["usage"]["output_tokens"] == 6
    assert "".join(e["token"] for e in logprobs) == message["content"][0]["text"]
    for entry in logprobs:
        assert entry["logprob"] <= 0 and len(entry["top_logprobs"]) == 2
        assert entry["top_logprobs"][0]["logprob"] >= entry["top_logprobs"][1]["logprob"]
    events, _ = stream(server, **ask)
    streamed = [lp for e in events if e["type"] == "response.output_text.delta" for lp in e["logprobs"]]
    [done] = [e for e in events if e["type"] == "response.output_text.done"]
    assert streamed == done["logprobs"]
    assert [e["token"] for e in streamed] == [e["token"] for e in logprobs]  # the same tokens (the values agree to rounding)
    assert [e["logprob"] for e in streamed] == pytest.approx([e["logprob"] for e in logprobs], abs=1e-3)
    assert create(server, input="Hi", max_output_tokens=2)["output"][0]["content"][0]["logprobs"] == []  # off unless asked


def _scripted(texts: list[str]) -> list[Piece]:
    """One piece per text, its tokens one per character (ids 100, 101, ...), each with a logprob."""
    pieces, token = [], 100
    for k, text in enumerate(texts):
        ids = list(range(token, token + len(text)))
        token += len(text)
        pieces.append(Piece(0, text=text, token_ids=ids, logprobs=[[t, -t / 1000, []] for t in ids],
                            finish_reason="stop" if k == len(texts) - 1 else None))
    return pieces


def _logprob_items(piece: Piece) -> list[dict[str, Any]]:
    return [{"token": str(t), "logprob": lp, "bytes": [], "top_logprobs": []} for t, lp, _ in piece.logprobs]


@pytest.mark.parametrize(
    ("texts", "parser", "types"),
    [
        (["Let me", " think.</th", "ink>\n\nHel", "lo", " there."], "think", ["reasoning", "message"]),
        (["Sure, ", "checking.", ' <tool_call>{"name": "f", "arguments": {}}</tool_call>'], "hermes", ["message", "function_call"]),
    ],
)
def test_unstreamed_logprobs_are_the_streamed_ones(texts: list[str], parser: str, types: list[str]) -> None:
    """An output with reasoning or a tool call beside its text: the non-streamed route's items carry
    the message's logprobs exactly as the stream sends them (they were dropped whole when the
    output held anything but text)."""

    def tool_stream() -> ToolStream:
        if parser == "think":
            return ToolStream(None, True, reasoning_stream("think", in_reasoning=True), incremental=True)
        return ToolStream(make_tool_parser("hermes", ["f"]).stream(), True, incremental=True)

    ctx: Any = SimpleNamespace(client=SimpleNamespace(state="ready"), metrics=Metrics(), activity=Activity())

    def body(status: str, output: list[dict[str, Any]], usage_doc: dict[str, Any] | None) -> dict[str, Any]:
        return response_body("resp_1", 0, MODEL, {"tools": [], "tool_choice": "auto", "parallel_tool_calls": True}, status=status,
                             output=output, usage_doc=usage_doc)

    async def rest() -> AsyncIterator[Piece]:
        for piece in _scripted(texts)[1:]:
            yield piece

    async def run() -> list[str]:
        events = response_events(
            ctx, "responses", rest(), _scripted(texts)[0], tally=Tally([3], [0]), clock=Clock(), parser=tool_stream(), body=body,
            usage_of=lambda t: usage(t.prompt_tokens, t.completion_tokens, 0), on_done=lambda final, ids: None,
            logprobs_of=_logprob_items,
        )
        return [frame async for frame in events]

    events = [json.loads(f.split("data: ", 1)[1]) for f in asyncio.run(run())]
    streamed = [lp for e in events if e["type"] == "response.output_text.delta" for lp in e["logprobs"]]
    items = collected_items(_scripted(texts), tool_stream(), incomplete=False, logprobs_of=_logprob_items).items
    assert [i["type"] for i in items] == types
    [message] = [i for i in items if i["type"] == "message"]
    assert streamed and message["content"][0]["logprobs"] == streamed
    def unnamed(output: list[dict[str, Any]]) -> list[dict[str, Any]]:  # item and call ids are fresh each time
        return [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in output]

    assert unnamed(items) == unnamed(events[-1]["response"]["output"])  # the whole output, not only its logprobs
