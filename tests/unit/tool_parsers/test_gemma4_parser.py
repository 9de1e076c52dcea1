"""The Gemma 4 tool-call format beyond the shared recorded cases: announced calls stay calls,
arguments stream as JSON while they are written (quote markers split across deltas), earlier calls
render in the template's value syntax and parse back, the forced-call grammar accepts a call in
the tokens of a Gemma 4 vocabulary, and Gemma 4 reasoning then a call through the chat routes'
stream."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import llguidance
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from recorded import GEMMA4_ANNOUNCED, TOOLS  # noqa: E402

from freetoken.tokenizer.reasoning import GEMMA4, reasoning_stream  # noqa: E402
from freetoken.tokenizer.tool_parsers import ToolCall, make_tool_parser  # noqa: E402
from freetoken.tokenizer.tool_parsers.base import merge_deltas  # noqa: E402
from freetoken.tokenizer.tool_parsers.gemma4 import ArgumentsJson, gemma_value  # noqa: E402

Q = '<|"|>'


@pytest.mark.parametrize(("text", "arguments"), GEMMA4_ANNOUNCED)
def test_announced_call_stays_a_call(text: str, arguments: str) -> None:
    out = make_tool_parser("gemma4", TOOLS).parse(text)
    assert out.content == "" and [c.arguments for c in out.tool_calls] == [arguments]


def test_arguments_stream_while_they_are_written() -> None:
    stream = make_tool_parser("gemma4", TOOLS).stream()
    first = stream.feed(f"Checking.<|tool_call>call:get_weather{{city:{Q}Os")
    assert first.content == "Checking."
    assert [(d.first, d.call.name, d.call.arguments) for d in first.tool_calls] == [(True, "get_weather", ""), (False, "", '{"city":"Os')]
    assert [d.call.arguments for d in stream.feed('lo<|"').tool_calls] == ["lo"]  # a split quote marker waits
    assert [d.call.arguments for d in stream.feed('|>,days:3').tool_calls] == ['","days":']  # so does a bare word
    rest = stream.feed("}<tool_call|>")
    assert [d.call.arguments for d in rest.tool_calls] == ["3}"]
    rest.extend(stream.finish())
    assert rest.content == ""


@pytest.mark.parametrize(
    ("gemma", "expected"),
    [
        (f"{{a:{Q}x{Q},b:[1,true,null],c:{{d:{Q}{Q}}}}}", {"a": "x", "b": [1, True, None], "c": {"d": ""}}),
        (f"{{{Q}quoted key{Q}:False, n : 1e3 }}", {"quoted key": False, "n": 1000.0}),
        (f"{{t:{Q}tab\there ☃{Q}}}", {"t": "tab\there ☃"}),
    ],
)
def test_arguments_translate_to_json_in_any_pieces(gemma: str, expected: dict) -> None:
    for size in (1, 2, 3, len(gemma)):
        conv = ArgumentsJson()
        text = "".join(conv.feed(gemma[i : i + size]) for i in range(0, len(gemma), size)) + conv.feed("", final=True)
        assert conv.done and json.loads(text) == expected


def test_format_calls_writes_the_template_syntax_and_parses_back() -> None:
    parser = make_tool_parser("gemma4", TOOLS)
    args = {"q": 'a "b" \\ c', "opts": {"n": 2, "exact": False, "tags": ["x", None]}}
    text = parser.format_calls([ToolCall("call_1", "search", json.dumps(args))])
    assert text == f'<|tool_call>call:search{{opts:{{exact:false,n:2,tags:[{Q}x{Q},null]}},q:{Q}a "b" \\ c{Q}}}<tool_call|>'
    assert [json.loads(c.arguments) for c in parser.parse(text).tool_calls] == [args]
    assert gemma_value("x") == f"{Q}x{Q}"
    assert parser.format_result("18 C", "get_weather") == f"<|tool_response>response:get_weather{{value:{Q}18 C{Q}}}<tool_response|>"


def test_reasoning_then_a_call_through_the_tool_stream() -> None:
    from freetoken.server.core.tool_calling import ToolStream

    text = f"<|channel>thought\nNeed the weather.<channel|><|tool_call>call:get_weather{{city:{Q}Oslo{Q}}}<tool_call|>"
    parser = make_tool_parser("gemma4", ["get_weather"])
    for size in (1, 4, len(text)):
        stream = ToolStream(parser.stream(), True, reasoning_stream(GEMMA4, in_reasoning=False), incremental=True)
        out = merge_deltas([stream.feed(text[i : i + size]) for i in range(0, len(text), size)] + [stream.finish()])
        assert (out.reasoning, out.content) == ("Need the weather.", "")
        assert [(c.name, c.arguments) for c in out.tool_calls] == [("get_weather", '{"city":"Oslo"}')]


def test_forced_grammar_takes_the_markers_as_tokens(tmp_path: Path) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tokenizer"))
    from test_tokenizer_gguf_gemma4 import write_gemma4_vocab

    from freetoken.engine.grammar import llg_tokenizer
    from freetoken.tokenizer import Tokenizer
    from freetoken.weights.gguf_metadata import read_metadata

    write_gemma4_vocab(tmp_path / "vocab.gguf")
    tokenizer = Tokenizer.from_gguf_metadata(read_metadata(tmp_path / "vocab.gguf"))
    tools = [{"type": "function", "function": {"name": "hello", "parameters": {"type": "object", "properties": {"w": {"type": "integer"}}}}}]
    grammar = make_tool_parser("gemma4", ["hello"]).forced_grammar(tools)
    for text, accepted in [('<|tool_call>call:hello{"w": 12}<tool_call|>', True), ('<|tool_call>call:hello{"w": "x"}<tool_call|>', False)]:
        matcher = llguidance.LLMatcher(llg_tokenizer(tokenizer), llguidance.LLMatcher.grammar_from_lark(grammar), log_level=0)
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert ids[0] == tokenizer.backend.token_to_id("<|tool_call>")  # the marker is one token
        assert (all(matcher.consume_token(i) for i in ids) and matcher.is_accepting()) == accepted, text
    out = make_tool_parser("gemma4", ["hello"]).parse('<|tool_call>call:hello{"w": 12}<tool_call|>')
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [("hello", {"w": 12})]


# The call rendering of Gemma 4's chat template (its `format_argument` with bare keys), restated
# for this test: values as the template writes them, keys sorted by `dictsort`.
CALL_TEMPLATE = """
{%- macro arg(v) -%}
{%- if v is string -%}<|"|>{{ v }}<|"|>
{%- elif v is boolean -%}{{ 'true' if v else 'false' }}
{%- elif v is mapping -%}{ {%- for k, x in v | dictsort -%}{%- if not loop.first -%},{%- endif -%}{{ k }}:{{ arg(x) }}{%- endfor -%} }
{%- elif v is sequence -%}[ {%- for x in v -%}{{ arg(x) }}{%- if not loop.last -%},{%- endif -%}{%- endfor -%} ]
{%- else -%}{{ v }}
{%- endif -%}
{%- endmacro -%}
{%- for m in messages -%}{%- for c in m.tool_calls -%}
<|tool_call>call:{{ c.function.name }}{ {%- for k, x in c.function.arguments | dictsort -%}{%- if not loop.first -%},{%- endif -%}{{ k }}:{{ arg(x) }}{%- endfor -%} }<tool_call|>
{%- endfor -%}{%- endfor -%}
"""


@pytest.mark.parametrize(
    "arguments",
    [
        {"city": "Paris"},
        {"q": 'He said "hi",\nthen {left}: a\\b', "n": 3, "ratio": 2.5, "exact": False, "tags": ["a", "b"]},
        {"filter": {"rows": [{"k": 1}, {"k": 2}], "empty": {}, "none": []}},
        {"page": None},  # the template writes Python's None as `None`
    ],
)
def test_what_the_template_renders_parses_back(arguments: dict) -> None:
    from freetoken.tokenizer.chat_template import ChatTemplate

    message = {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "search", "arguments": arguments}}]}
    rendered = ChatTemplate(CALL_TEMPLATE).render([message], add_generation_prompt=False)
    parser = make_tool_parser("gemma4", TOOLS)
    assert [json.loads(c.arguments) for c in parser.parse(rendered).tool_calls] == [arguments]
    if None not in arguments.values():  # format_calls writes the template's syntax (null for None)
        assert parser.format_calls([ToolCall("call_1", "search", json.dumps(arguments))]) == rendered
