"""Qwen3-Coder's XML, GLM-4.5's tag pairs and Mistral's `[TOOL_CALLS]`: values typed by the tools'
schemas, the name announced before the arguments stream, the same calls whole and char by char,
and the forced-call grammars' shape."""

from __future__ import annotations

import json

import llguidance
import pytest

from freetoken.tokenizer.tool_parsers import make_tool_parser
from freetoken.tokenizer.tool_parsers.base import join_calls
from freetoken.tokenizer.tool_parsers.typed_arguments import typed_value, value_types

SCHEMA = {
    "type": "object",
    "properties": {
        "q": {"type": "string"},
        "n": {"type": "integer"},
        "ratio": {"type": "number"},
        "exact": {"type": "boolean"},
        "filter": {"type": "object"},
        "tags": {"type": "array"},
        "mode": {"enum": ["fast", "slow"]},
        "page": {"type": ["integer", "null"]},
    },
    "required": ["q"],
}
SCHEMAS = {"search": SCHEMA}
TYPED = {"q": '3 "quoted" {not json}', "n": 12, "ratio": -2.5, "exact": False, "filter": {"a": [1, {"b": None}]},
         "tags": ["x", "y"], "mode": "fast", "page": None}


def qwen(args: dict[str, str]) -> str:
    params = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in args.items())
    return f"<tool_call>\n<function=search>\n{params}</function>\n</tool_call>"


def glm(args: dict[str, str]) -> str:
    pairs = "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{v}</arg_value>\n" for k, v in args.items())
    return f"<tool_call>search\n{pairs}</tool_call>"


RAW = {"q": '3 "quoted" {not json}', "n": "12", "ratio": "-2.5", "exact": "False", "filter": '{"a": [1, {"b": null}]}',
       "tags": '["x", "y"]', "mode": "fast", "page": "None"}


@pytest.mark.parametrize("text", [qwen(RAW), glm(RAW)], ids=["qwen3_coder", "glm45"])
def test_values_are_typed_by_the_schema_whole_and_char_by_char(text: str) -> None:
    parser = make_tool_parser("qwen3_coder" if "<function=" in text else "glm45", ["search"], schemas=SCHEMAS)
    whole = parser.parse(text)
    assert [(c.name, json.loads(c.arguments)) for c in whole.tool_calls] == [("search", TYPED)]
    stream = parser.stream()
    deltas = [stream.feed(ch) for ch in text] + [stream.finish()]
    pieces = [d for delta in deltas for d in delta.tool_calls]
    assert [(c.name, c.arguments) for c in join_calls(pieces)] == [(c.name, c.arguments) for c in whole.tool_calls]
    assert "".join(d.content for d in deltas) == whole.content == ""


@pytest.mark.parametrize(
    ("parser", "head", "more"),
    [
        ("qwen3_coder", "<tool_call>\n<function=search>\n<parameter=q>\nhello wor", "ld\n</parameter>\n</function>\n</tool_call>"),
        ("glm45", "<tool_call>search\n<arg_key>q</arg_key>\n<arg_value>hello wor", "ld</arg_value>\n</tool_call>"),
        ("mistral", '[TOOL_CALLS]search[ARGS]{"q": "hello wor', 'ld"}'),
        ("mistral", '[TOOL_CALLS][{"name": "search", "arguments": {"q": "hello wor', 'ld"}}]'),
    ],
)
def test_the_name_comes_first_then_the_arguments_stream(parser: str, head: str, more: str) -> None:
    stream = make_tool_parser(parser, ["search"], schemas=SCHEMAS).stream()
    first = stream.feed(head).tool_calls
    assert first[0].first and first[0].call.name == "search" and first[0].call.arguments == ""
    assert "hello wor" in "".join(d.call.arguments for d in first[1:])  # the string streamed before it ended
    rest = stream.feed(more).tool_calls + stream.finish().tool_calls
    assert not any(d.first for d in rest)
    assert json.loads("".join(d.call.arguments for d in first + rest)) == {"q": "hello world"}


def test_a_string_value_holds_back_only_what_may_be_its_end() -> None:
    stream = make_tool_parser("qwen3_coder", ["search"]).stream()
    stream.feed("<function=search>\n<parameter=q>\n")
    assert [d.call.arguments for d in stream.feed("a\n").tool_calls] == ["a"]  # the newline may end the value
    assert [d.call.arguments for d in stream.feed("b</para").tool_calls] == ["\\nb"]
    assert [d.call.arguments for d in stream.feed("meter>\n</function>").tool_calls] == ['"', "}"]


@pytest.mark.parametrize(
    ("raw", "schema", "value"),
    [
        ("42", {"type": "integer"}, 42),
        ("4.5", {"type": "integer"}, "4.5"),  # not of the schema's type: the text
        ("true", {"type": "boolean"}, True),
        ("True", {"type": "boolean"}, True),  # Qwen's template writes Python's spelling
        ("yes", {"type": "boolean"}, "yes"),
        ("null", {"type": ["string", "null"]}, None),
        ('{"a": 1}', {"type": "object"}, {"a": 1}),
        ('{"a": 1}', {"type": "string"}, '{"a": 1}'),
        ("7", {"enum": [7, 8]}, 7),
        ("7", None, "7"),  # an undeclared parameter is text
        ("[1, 2]", {"anyOf": [{"type": "array"}, {"type": "string"}]}, [1, 2]),
    ],
)
def test_typed_value(raw: str, schema: dict | None, value: object) -> None:
    assert typed_value(raw, value_types(schema)) == value


TOOLS = [
    {"type": "function", "function": {"name": "search", "parameters": SCHEMA}},
    {"type": "function", "function": {"name": "ping"}},
]


@pytest.mark.parametrize("parser", ["qwen3_coder", "glm45", "mistral"])
def test_forced_grammar_names_every_tool_and_parameter(parser: str) -> None:
    grammar = make_tool_parser(parser, ["search", "ping"], schemas=SCHEMAS).forced_grammar(TOOLS)
    llguidance.LLMatcher.grammar_from_lark(grammar)  # raises on a grammar llguidance cannot read
    assert "search" in grammar and "ping" in grammar
    if parser != "mistral":  # the required parameter is not optional, the others are; an enum is its literals
        assert "p0_0 p0_1? p0_2?" in grammar and '"fast" | "slow"' in grammar
    marked = make_tool_parser(parser, ["search"], marker_tokens={"[TOOL_CALLS]": 7, "<tool_call>": 8}).forced_grammar(TOOLS)
    assert ("<[7]>" if parser == "mistral" else "<[8]>") in marked
