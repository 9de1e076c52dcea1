"""Each tool-call parser on recorded model outputs (well-formed and malformed), the stream/full
parse agreement under any chunking, marker hold-back, and the prompt/format round trip."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import llguidance  # a hard dependency (pyproject): its absence must fail, not skip
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parent))

from recorded import (  # noqa: E402
    ANNOUNCED_JSON, ANNOUNCED_NAMED, GEMMA, GEMMA4, GEMMA4_MALFORMED, GEMMA_MALFORMED, GLM45, GLM45_MALFORMED, HARMONY, HARMONY_ANNOUNCED, HARMONY_MALFORMED, HERMES,
    HERMES_ANNOUNCED, HERMES_MALFORMED, LLAMA3, LLAMA3_MALFORMED, MISTRAL, MISTRAL_MALFORMED, QWEN3_CODER, QWEN3_CODER_MALFORMED, TOOLS, Case,
)

from freetoken.tokenizer.tool_parsers import ParsedOutput, ToolCall, make_tool_parser  # noqa: E402
from freetoken.tokenizer.tool_parsers.base import join_calls  # noqa: E402

CASES: dict[str, tuple[list[Case], list[str]]] = {
    "hermes": (HERMES, HERMES_MALFORMED),
    "gemma": (GEMMA, GEMMA_MALFORMED),
    "gemma4": (GEMMA4, GEMMA4_MALFORMED),
    "llama3_json": (LLAMA3, LLAMA3_MALFORMED),
    "harmony": (HARMONY, HARMONY_MALFORMED),
    "qwen3_coder": (QWEN3_CODER, QWEN3_CODER_MALFORMED),
    "glm45": (GLM45, GLM45_MALFORMED),
    "mistral": (MISTRAL, MISTRAL_MALFORMED),
}
ALL = [(name, case) for name, (good, _) in CASES.items() for case in good]
ALL_BAD = [(name, text) for name, (_, bad) in CASES.items() for text in bad]


def summary(out: ParsedOutput) -> tuple[str, str, list[tuple[str, dict]]]:
    return out.content, out.reasoning, [(c.name, json.loads(c.arguments)) for c in out.tool_calls]


@pytest.mark.parametrize(("parser", "case"), ALL)
def test_recorded_output(parser: str, case: Case) -> None:
    text, content, reasoning, calls = case
    out = make_tool_parser(parser, TOOLS).parse(text)
    assert summary(out) == (content, reasoning, calls)
    for call in out.tool_calls:
        assert call.id.startswith("call_") and len(call.id) > 10
        assert isinstance(json.loads(call.arguments), dict)
    assert len({c.id for c in out.tool_calls}) == len(out.tool_calls)


@pytest.mark.parametrize(("parser", "text"), ALL_BAD)
def test_malformed_output_is_text(parser: str, text: str) -> None:
    out = make_tool_parser(parser, TOOLS).parse(text)
    assert out.tool_calls == ()
    assert out.content.strip(), out
    # nothing of the model's text is lost: its non-marker characters all come back
    assert "".join(ch for ch in text if ch.isalnum()) in "".join(ch for ch in out.content if ch.isalnum()) or parser == "harmony"


@pytest.mark.parametrize("parser", list(CASES))
def test_unknown_tools_accepted_without_a_tool_list(parser: str) -> None:
    good, _ = CASES[parser]
    text, _, _, calls = next(c for c in good if c[3])
    assert [c.name for c in make_tool_parser(parser, None).parse(text).tool_calls] == [n for n, _ in calls]
    assert make_tool_parser(parser, []).parse(text).tool_calls == ()


def chunked(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts})
    return [text[a:b] for a, b in zip([0, *points], [*points, len(text)])]


@settings(max_examples=60, deadline=None)
@given(index=st.integers(0, len(ALL) + len(ALL_BAD) - 1), cuts=st.lists(st.integers(0, 10_000), max_size=12))
def test_streaming_equals_full_parse_for_any_chunking(index: int, cuts: list[int]) -> None:
    parser, text = (ALL[index][0], ALL[index][1][0]) if index < len(ALL) else ALL_BAD[index - len(ALL)]
    p = make_tool_parser(parser, TOOLS)
    stream = p.stream()
    deltas = [stream.feed(piece) for piece in chunked(text, cuts)] + [stream.finish()]
    content = "".join(d.content for d in deltas)
    reasoning = "".join(d.reasoning for d in deltas)
    pieces = [tc for d in deltas for tc in d.tool_calls]
    assert [tc.index for tc in pieces if tc.first] == list(range(len([tc for tc in pieces if tc.first])))
    assert all(tc.index == prev.index for prev, tc in zip(pieces, pieces[1:]) if not tc.first)  # fragments follow their call
    calls = join_calls(pieces)
    whole = p.parse(text)
    assert (content, reasoning, [(c.name, c.arguments) for c in calls]) == (
        whole.content, whole.reasoning, [(c.name, c.arguments) for c in whole.tool_calls],
    )


@pytest.mark.parametrize(("text", "arguments"), HERMES_ANNOUNCED)
def test_hermes_announced_call_stays_a_call(text: str, arguments: str) -> None:
    out = make_tool_parser("hermes", TOOLS).parse(text)
    assert out.content == "" and [(c.name, c.arguments) for c in out.tool_calls] == [(text.split('"')[3], arguments)]


@pytest.mark.parametrize(("text", "arguments"), HARMONY_ANNOUNCED)
def test_harmony_announced_call_stays_a_call(text: str, arguments: str) -> None:
    out = make_tool_parser("harmony", TOOLS).parse(text)
    assert out.content == "" and [c.arguments for c in out.tool_calls] == [arguments]


@pytest.mark.parametrize(("parser", "text", "content", "calls"), ANNOUNCED_JSON)
def test_gemma_llama3_announced_call_stays_a_call(parser: str, text: str, content: str, calls: list[tuple[str, str]]) -> None:
    out = make_tool_parser(parser, TOOLS).parse(text)
    assert out.content == content and [(c.name, c.arguments) for c in out.tool_calls] == calls


@pytest.mark.parametrize(("parser", "text", "content", "calls"), ANNOUNCED_NAMED)
def test_named_formats_announced_call_stays_a_call(parser: str, text: str, content: str, calls: list[tuple[str, str]]) -> None:
    out = make_tool_parser(parser, TOOLS).parse(text)
    assert out.content == content and [(c.name, c.arguments) for c in out.tool_calls] == calls


@pytest.mark.parametrize(
    ("parser", "head", "tail"),
    [
        ("gemma", '```tool_call\n{"name": "get_weather", "parameters": {"ci', "\n```"),
        ("gemma", '{"name": "get_weather", "arguments": {"ci', ""),  # a bare call object opening the output
        ("llama3_json", '{"name": "get_weather", "parameters": {"ci', ""),
        ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"ci', ""),
    ],
)
def test_gemma_llama3_stream_arguments_while_they_are_written(parser: str, head: str, tail: str) -> None:
    stream = make_tool_parser(parser, TOOLS).stream()
    first = stream.feed(head)
    assert [(d.first, d.call.name, d.call.arguments) for d in first.tool_calls] == [(True, "get_weather", ""), (False, "", '{"ci')]
    assert [d.call.arguments for d in stream.feed('ty": "Oslo"}').tool_calls] == ['ty": "Oslo"}']
    rest = stream.feed("}" + tail)
    rest.extend(stream.finish())
    assert not rest.tool_calls and rest.content == ""


def test_llama3_streams_each_of_several_calls() -> None:
    stream = make_tool_parser("llama3_json", TOOLS).stream()
    deltas = [stream.feed(piece) for piece in ['{"name": "search", "parameters": {"q"', ': "a"}}; {"name": "get_w', 'eather", "parameters": {}}']]
    deltas.append(stream.finish())
    flat = [(d.index, d.first, d.call.name, d.call.arguments) for delta in deltas for d in delta.tool_calls]
    assert flat == [(0, True, "search", ""), (0, False, "", '{"q"'), (0, False, "", ': "a"}'), (1, True, "get_weather", ""), (1, False, "", "{}")]


def test_hermes_streams_arguments_while_they_are_written() -> None:
    stream = make_tool_parser("hermes", TOOLS).stream()
    first = stream.feed('<tool_call>\n{"name": "get_weather", "arguments": {"ci')
    assert [(d.first, d.call.name, d.call.arguments) for d in first.tool_calls] == [(True, "get_weather", ""), (False, "", '{"ci')]
    assert [d.call.arguments for d in stream.feed('ty": "Oslo"}').tool_calls] == ['ty": "Oslo"}']
    assert not stream.feed("}\n</tool_").tool_calls
    assert stream.feed("call> done").content == "done"


def test_hermes_holds_back_a_possible_marker_and_streams_text() -> None:
    stream = make_tool_parser("hermes", TOOLS).stream()
    assert stream.feed("Hello <tool").content == "Hello"
    assert stream.feed("_c").content == ""
    delta = stream.feed('all>{"name": "search", "arguments": {"q": 1}}</tool_call>')
    assert delta.content == "" and [(c.name, c.arguments) for c in join_calls(delta.tool_calls)] == [("search", '{"q": 1}')]
    assert stream.feed(" bye").content == "bye"
    assert not stream.finish()


def test_hermes_releases_a_false_start() -> None:
    stream = make_tool_parser("hermes", TOOLS).stream()
    assert stream.feed("a <tool").content == "a"
    assert stream.feed("box> b").content == " <toolbox> b"


def test_harmony_streams_reasoning_before_the_call_closes() -> None:
    stream = make_tool_parser("harmony", TOOLS).stream()
    assert stream.feed("<|channel|>analysis<|message|>Think").reasoning == "Think"
    assert stream.feed("ing<|e").reasoning == "ing"
    d = stream.feed("nd|><|start|>assistant<|channel|>commentary to=functions.search <|constrain|>json<|message|>{\"q\"")
    assert [(c.first, c.call.name, c.call.arguments) for c in d.tool_calls] == [(True, "search", ""), (False, "", '{"q"')]
    d = stream.feed(': "a"}\n<|ca')
    assert [c.call.arguments for c in d.tool_calls] == [': "a"}']  # the whitespace and a possible marker wait
    assert not stream.feed("ll|>").tool_calls


def test_llama3_text_streams_at_once() -> None:
    stream = make_tool_parser("llama3_json", TOOLS).stream()
    assert stream.feed("  ").content == ""
    assert stream.feed("Hi").content == "  Hi"


@pytest.mark.parametrize("parser", list(CASES))
def test_format_calls_parses_back(parser: str) -> None:
    p = make_tool_parser(parser, TOOLS)
    calls = [ToolCall("call_1", "get_weather", '{"city": "Paris"}'), ToolCall("call_2", "search", '{"q": "x y"}')]
    out = p.parse(p.format_calls(calls))
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [("get_weather", {"city": "Paris"}), ("search", {"q": "x y"})]


@pytest.mark.parametrize("parser", list(CASES))
def test_tool_prompt_lists_schemas(parser: str) -> None:
    tool = {"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": {"type": "object"}}}
    prompt = make_tool_parser(parser, TOOLS).tool_prompt([tool], parallel=True)
    assert json.dumps(tool["function"]) in prompt


@pytest.mark.parametrize("parser", list(CASES))
def test_forced_grammar_compiles_and_names_each_tool(parser: str) -> None:
    tools = [
        {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris"]}}}}},
        {"type": "function", "function": {"name": "search"}},
    ]
    grammar = make_tool_parser(parser, TOOLS).forced_grammar(tools)
    assert "get_weather" in grammar and "search" in grammar and '"Paris"' in grammar
    llguidance.LLMatcher.grammar_from_lark(grammar)  # raises on a grammar llguidance cannot read
