"""The reasoning split (`<think>`, Gemma 4's `<|channel>thought` and Magistral's `[THINK]`): whole and streamed in every
chunking give the same result, reasoning opened in the prompt, markers split across deltas,
unclosed reasoning, plain output, and detection from the template or vocabulary."""

from __future__ import annotations

import pytest

from freetoken.tokenizer.reasoning import (
    GEMMA4,
    MISTRAL,
    ThinkStream,
    detect_reasoning_parser,
    reasoning_stream,
    split_reasoning,
)

THINK_NAME = "think"
CASES = [
    ("<think>\nLet me see.\n</think>\n\nParis.", False, ("Let me see.", "Paris.")),
    ("  <think>a  b</think>c", False, ("a  b", "c")),
    ("Plain answer <think> not reasoning", False, ("", "Plain answer <think> not reasoning")),
    ("\nsteps 1 and 2\n</think>\n\nDone", True, ("steps 1 and 2", "Done")),
    ("<think>cut off mid thou", False, ("cut off mid thou", "")),
    ("<thi", False, ("", "<thi")),
    ("<think></think>", False, ("", "")),
    ("reasoning only", True, ("reasoning only", "")),
    ("<think>x</think>y <think>z</think>", False, ("x", "y <think>z</think>")),
]


# Gemma 4 (thinking on: `<|think|>` in the system turn); an empty block when thinking is off
GEMMA4_CASES = [
    ("<|channel>thought\nThe user wants X.\n<channel|>The answer.", False, ("The user wants X.", "The answer.")),
    ("<|channel>thought\n<channel|>Hi.", False, ("", "Hi.")),
    ("Hi <|channel>thought not at the start", False, ("", "Hi <|channel>thought not at the start")),
    ("<|channel>thought\ncut o", False, ("cut o", "")),
    ("<think>x</think>y", False, ("", "<think>x</think>y")),
]
# Magistral Small 2509: `[THINK]` and `[/THINK]` are control tokens, decoded with the rest
MISTRAL_CASES = [
    ("[THINK]The user asks for 2+2. That is 4.[/THINK]The answer is 4.", False, ("The user asks for 2+2. That is 4.", "The answer is 4.")),
    ("[THINK]\nStep one.\n[/THINK]\n\n**4**", False, ("Step one.", "**4**")),
    ("[THINK]cut off mid thou", False, ("cut off mid thou", "")),
    ("[THI", False, ("", "[THI")),
    ("No reasoning [THINK] here", False, ("", "No reasoning [THINK] here")),
    ("<think>x</think>y", False, ("", "<think>x</think>y")),
]
ALL_CASES = (
    [(THINK_NAME, *c) for c in CASES] + [(GEMMA4, *c) for c in GEMMA4_CASES] + [(MISTRAL, *c) for c in MISTRAL_CASES]
)


@pytest.mark.parametrize(("name", "text", "opened", "expected"), ALL_CASES)
def test_whole_and_every_chunking_agree(name: str, text: str, opened: bool, expected: tuple[str, str]) -> None:
    assert split_reasoning(text, in_reasoning=opened, name=name) == expected
    for size in (1, 2, 3, 5):
        stream = reasoning_stream(name, in_reasoning=opened)
        parts = [stream.feed(text[i : i + size]) for i in range(0, len(text), size)] + [stream.finish()]
        assert ("".join(r for r, _ in parts), "".join(c for _, c in parts)) == expected, size


def test_reasoning_streams_before_the_end_marker() -> None:
    stream = ThinkStream(in_reasoning=False)
    assert stream.feed("<think>first") == ("first", "")
    assert stream.feed(" second </th") == (" second", "")  # the marker's start and the trailing space wait
    assert stream.feed("ink>answer") == ("", "answer")


def test_detection() -> None:
    assert detect_reasoning_parser(chat_template="{{ '<think>' }}...</think>", tokens=[]) == "think"
    assert detect_reasoning_parser(chat_template=None, tokens=["<|im_start|>", "</think>"]) == "think"
    assert detect_reasoning_parser(chat_template="<|im_start|>", tokens=["<|im_start|>"]) is None
    assert detect_reasoning_parser(chat_template="{{ '<|channel>thought' }}...{{ '<channel|>' }}", tokens=[]) == GEMMA4
    assert detect_reasoning_parser(chat_template=None, tokens=["<|turn>", "<channel|>"]) == GEMMA4
    assert detect_reasoning_parser(chat_template="{{ '<|channel|>' }}", tokens=[]) is None  # Harmony's is not Gemma 4's
    # Magistral 2509: the markers are control tokens, and its default system prompt names them
    assert detect_reasoning_parser(chat_template=None, tokens=["[INST]", "[THINK]", "[/THINK]"]) == MISTRAL
    magistral = "{%- set default_system_message = 'First draft your thinking process ... [THINK]your thoughts[/THINK]' %}"
    assert detect_reasoning_parser(chat_template=magistral, tokens=["[INST]"]) == MISTRAL
    assert detect_reasoning_parser(chat_template="[INST]{{ m }}[/INST]", tokens=["[INST]", "[/INST]"]) is None


def test_reasoning_then_a_call_through_the_tool_stream() -> None:
    """The chat routes' stream: reasoning split off first, then the content's tool calls, the
    same whole as streamed in pieces."""
    from freetoken.server.core.tool_calling import ToolStream
    from freetoken.tokenizer.tool_parsers import make_tool_parser
    from freetoken.tokenizer.tool_parsers.base import merge_deltas

    text = '<think>Need the weather.</think>\n<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    parser = make_tool_parser("hermes", ["get_weather"])
    for size in (1, 4, len(text)):
        stream = ToolStream(parser.stream(), True, ThinkStream(in_reasoning=False), incremental=True)
        out = merge_deltas([stream.feed(text[i : i + size]) for i in range(0, len(text), size)] + [stream.finish()])
        assert (out.reasoning, out.content) == ("Need the weather.", "")
        assert [(c.name, c.arguments) for c in out.tool_calls] == [("get_weather", '{"city": "Oslo"}')]
        assert stream.num_calls == 1
