"""Qwen3's real chat template (`qwen3_chat_template.jinja`: Qwen/Qwen3-0.6B's, as llama.cpp keeps
it in models/templates/Qwen-Qwen3-0.6B.jinja) over a tiny tokenizer that, like Qwen3's, has
`<think>`, `</think>`, `<tool_call>` and `</tool_call>` as ordinary added tokens, meeting the
server's reasoning and tool-call parsing.

The template leaves the reasoning to the model (the generation prompt does not open `<think>`;
`enable_thinking: false` writes an empty block), renders earlier turns' reasoning only after the
last user query, and writes Hermes `<tool_call>` blocks. The model's `<think>...</think>answer`,
detokenized token by token as the server streams it, comes back as reasoning and content; a
think block followed by a call comes back as reasoning and one tool call.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from tokenizers import AddedToken
from tokenizers import Tokenizer as Backend

from freetoken.server.core.tool_calling import ToolCalling, ToolOptions
from freetoken.tokenizer.detokenizer import IncrementalDetokenizer
from freetoken.tokenizer.reasoning import detect_reasoning_parser
from freetoken.tokenizer.testing import write_tiny_tokenizer
from freetoken.tokenizer.tokenizer import Tokenizer
from freetoken.tokenizer.tool_parsers.registry import detect_tool_parser

TEMPLATE = (Path(__file__).parent / "qwen3_chat_template.jinja").read_text()
QWEN3_ADDED = ("<think>", "</think>", "<tool_call>", "</tool_call>")  # not special in Qwen3's tokenizer
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    directory = write_tiny_tokenizer(tmp_path_factory.mktemp("qwen3_tok"), vocab_size=320)
    backend = Backend.from_file(str(directory / "tokenizer.json"))
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in QWEN3_ADDED])
    backend.save(str(directory / "tokenizer.json"))
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["chat_template"] = TEMPLATE
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return Tokenizer.from_pretrained_dir(directory)


def calling(tokenizer: Tokenizer, options: ToolOptions, thinking: bool | None = None) -> ToolCalling:
    """The chat routes' output handling for this model, as the server builds it (auto-detected parsers)."""
    ctx: Any = SimpleNamespace(
        tokenizer=tokenizer,
        config=SimpleNamespace(tool_call_parser=None, reasoning_parser=None),
        client=SimpleNamespace(info=SimpleNamespace(architecture="qwen3")),
    )
    return ToolCalling(ctx, options, thinking)


def stream_tokens(tokenizer: Tokenizer, handling: ToolCalling, output: str) -> tuple[list[str], str, list[Any]]:
    """Feed `output` as generated ids through the incremental detokenizer and the parse stream:
    (the reasoning deltas, the content, the tool calls)."""
    ids = tokenizer.encode(output, add_special_tokens=False)
    assert len(ids) > 10  # really streamed in pieces
    detok = IncrementalDetokenizer(tokenizer)
    stream = handling.stream()
    reasoning: list[str] = []
    content, calls = "", []
    for delta in [stream.feed(detok.add(i).text) for i in ids] + [stream.feed(detok.finish().text), stream.finish()]:
        if delta.reasoning:
            reasoning.append(delta.reasoning)
        content += delta.content
        calls += [c.call for c in delta.tool_calls if c.call is not None]
    return reasoning, content, calls


def test_the_template_leaves_thinking_to_the_model(tokenizer: Tokenizer) -> None:
    user = [{"role": "user", "content": "Hi"}]
    assert tokenizer.apply_chat_template(user) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    off = tokenizer.apply_chat_template(user, extra_context={"enable_thinking": False})
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert tokenizer.encode("<think>", add_special_tokens=False) == [tokenizer.token_to_id("<think>")]
    assert detect_reasoning_parser(chat_template=tokenizer.chat_template, tokens=[]) == "think"
    assert (
        detect_tool_parser(chat_template=tokenizer.chat_template, special_tokens=[], architecture="qwen3") == "hermes"
    )
    handling = calling(tokenizer, ToolOptions())
    assert handling.reasoning == "think"
    assert handling.template_context() is None  # the request did not say: the template's default (thinking on)
    assert calling(tokenizer, ToolOptions(), thinking=False).template_context() == {"enable_thinking": False}


def test_history_keeps_reasoning_only_after_the_last_query(tokenizer: Tokenizer) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "<think>\nold thoughts\n</think>\n\nWhich city?"},
        {"role": "user", "content": "Paris"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "need the tool",
            "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
        },
        {"role": "tool", "content": "sunny"},
    ]
    text = tokenizer.apply_chat_template(messages, tools=[WEATHER])
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert json.dumps(WEATHER) in text
    assert "old thoughts" not in text and "<|im_start|>assistant\nWhich city?<|im_end|>" in text
    assert (
        "<|im_start|>assistant\n<think>\nneed the tool\n</think>\n\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>'
    ) in text
    assert text.endswith(
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )


def test_streamed_think_block_splits_into_reasoning_and_content(tokenizer: Tokenizer) -> None:
    output = "<think>\nThe user says hello. I should greet them back.\n</think>\n\nHello! How can I help you today?"
    reasoning, content, calls = stream_tokens(tokenizer, calling(tokenizer, ToolOptions()), output)
    assert "".join(reasoning) == "The user says hello. I should greet them back."
    assert len(reasoning) > 3  # the reasoning streamed as it was written, before `</think>`
    assert content == "Hello! How can I help you today?"
    assert not calls


def test_think_then_a_tool_call(tokenizer: Tokenizer) -> None:
    output = (
        "<think>\nI need the weather tool.\n</think>\n\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    )
    handling = calling(tokenizer, ToolOptions(tools=(WEATHER,), choice="auto"))
    reasoning, content, calls = stream_tokens(tokenizer, handling, output)
    assert "".join(reasoning) == "I need the weather tool."
    assert content.strip() == ""
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]


def test_forced_call_grammar_takes_the_added_marker_tokens(tokenizer: Tokenizer) -> None:
    """`<tool_call>` is an added token (llguidance takes those for special ones): the forced grammar
    names it by id, so the model writes the token, and the call's canonical tokens are accepted."""
    import llguidance

    from freetoken.engine.grammar import llg_tokenizer
    from freetoken.request import SamplingParams

    handling = calling(tokenizer, ToolOptions(tools=(WEATHER,), choice="required"))
    grammar = handling.sampling(SamplingParams(max_tokens=64)).grammar
    assert grammar is not None and f"<[{tokenizer.token_to_id('<tool_call>')}]>" in grammar[1]
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    matcher = llguidance.LLMatcher(llg_tokenizer(tokenizer), llguidance.LLMatcher.grammar_from_lark(grammar[1]), log_level=0)
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids[0] == tokenizer.token_to_id("<tool_call>")
    assert all(matcher.consume_token(i) for i in ids) and matcher.is_accepting()
