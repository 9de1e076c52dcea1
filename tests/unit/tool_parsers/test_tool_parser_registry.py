"""Choosing the tool-call format from the model, and the registry's names."""

from __future__ import annotations

import pytest

from freetoken.errors import ConfigError
from freetoken.tokenizer.testing import CHATML_TEMPLATE
from freetoken.tokenizer.chat_template import GEMMA3_CHAT_TEMPLATE
from freetoken.tokenizer.tool_parsers import TOOL_PARSERS, detect_tool_parser, make_tool_parser


def test_names() -> None:
    assert set(TOOL_PARSERS) == {"hermes", "gemma", "gemma4", "llama3_json", "harmony"}
    for name in TOOL_PARSERS:
        assert make_tool_parser(name).name == name
    with pytest.raises(ConfigError, match="hermes"):
        make_tool_parser("mistral")


@pytest.mark.parametrize(
    ("template", "special", "arch", "expected"),
    [
        (CHATML_TEMPLATE, [], "llama", "hermes"),  # SmolLM2: ChatML on a Llama architecture
        (CHATML_TEMPLATE, [], "gemma3_text", "hermes"),  # the tiny test Gemma ships ChatML
        (GEMMA3_CHAT_TEMPLATE, [], "gemma3", "gemma"),
        (None, ["<start_of_turn>", "<end_of_turn>"], "gemma3", "gemma"),
        ("{{ '<|start_header_id|>' }}{{ '<|eot_id|>' }}", [], "llama", "llama3_json"),
        ("{{ '<|start|>' }}{{ '<|channel|>' }}", [], "gpt_oss", "harmony"),
        (None, [], "gpt_oss", "harmony"),
        (None, [], "unknown_arch", "hermes"),
        ("{{ '<|turn>user\\n' }}{{ '<|tool_call>call:' }}", [], "gemma4", "gemma4"),  # Gemma 4's template
        (None, ["<|turn>", "<turn|>"], "llama", "gemma4"),
        (None, [], "gemma4_text", "gemma4"),
    ],
)
def test_detect(template: str | None, special: list[str], arch: str, expected: str) -> None:
    assert detect_tool_parser(chat_template=template, special_tokens=special, architecture=arch) == expected


def test_only_harmony_and_gemma4_need_special_tokens() -> None:
    assert [n for n, cls in TOOL_PARSERS.items() if cls.needs_special_tokens] == ["gemma4", "harmony"]
