"""Anthropic shapes of tool calling: tools/tool_choice mapping, content blocks, stream events."""

from __future__ import annotations

import json

import pytest

from freetoken.server.anthropic.tool_blocks import AnthropicBlockStream, anthropic_content, anthropic_tool_options, tool_stop_reason
from freetoken.server.errors import APIError
from freetoken.tokenizer.tool_parsers import make_tool_parser

TOOLS = [{"name": "get_weather", "description": "Weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]


def test_tool_choice_mapping() -> None:
    assert anthropic_tool_options(TOOLS, None).choice == "auto"
    assert anthropic_tool_options(TOOLS, {"type": "any"}).forced
    named = anthropic_tool_options(TOOLS, {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True})
    assert named.named == "get_weather" and named.forced and not named.parallel
    assert not anthropic_tool_options(TOOLS, {"type": "none"}).active
    opts = anthropic_tool_options(TOOLS, None)
    assert opts.tools[0]["function"]["parameters"] == TOOLS[0]["input_schema"]


@pytest.mark.parametrize("choice", [{"type": "tool", "name": "nope"}, {"type": "sometimes"}])
def test_bad_tool_choice_is_400(choice: dict) -> None:
    with pytest.raises(APIError) as err:
        anthropic_tool_options(TOOLS, choice)
    assert err.value.status == 400


def test_content_blocks_and_stream_events() -> None:
    text = 'Checking.<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    parser = make_tool_parser("hermes", ["get_weather"])
    blocks = anthropic_content(parser.parse(text))
    assert blocks[0] == {"type": "text", "text": "Checking."}
    assert blocks[1]["type"] == "tool_use" and blocks[1]["id"].startswith("toolu_") and blocks[1]["input"] == {"city": "Oslo"}
    assert tool_stop_reason("end_turn", 1) == "tool_use" and tool_stop_reason("end_turn", 0) == "end_turn"

    stream, blocks_stream = parser.stream(), AnthropicBlockStream()
    events = []
    for ch in text:
        events += blocks_stream.events(stream.feed(ch))
    events += blocks_stream.events(stream.finish()) + blocks_stream.close()
    names = [name for name, _ in events]
    call_start = names.index("content_block_start", 1)
    assert names[call_start - 1] == "content_block_stop" and names[-1] == "content_block_stop"
    start = events[call_start][1]
    assert start["index"] == 1 and start["content_block"]["name"] == "get_weather"
    pieces = [e[1]["delta"]["partial_json"] for e in events[call_start + 1 : -1]]
    assert len(pieces) > 1 and all(e[1]["index"] == 1 for e in events[call_start + 1 :])  # written as they came
    assert json.loads("".join(pieces)) == {"city": "Oslo"}
    assert "".join(e[1]["delta"]["text"] for e in events if e[1].get("delta", {}).get("type") == "text_delta") == "Checking."
