"""Choosing the tool-call format from the model, and the registry's names."""

from __future__ import annotations

import pytest

from freetoken.errors import ConfigError
from freetoken.tokenizer.testing import CHATML_TEMPLATE
from freetoken.families.gemma3 import CHAT_TEMPLATE as GEMMA3_CHAT_TEMPLATE
from freetoken.tokenizer.tool_parsers import TOOL_PARSERS, detect_tool_parser, make_tool_parser


def test_names() -> None:
    assert set(TOOL_PARSERS) == {"hermes", "gemma", "gemma4", "llama3_json", "harmony", "qwen3_coder", "glm45", "mistral"}
    for name in TOOL_PARSERS:
        assert make_tool_parser(name).name == name
    with pytest.raises(ConfigError, match="hermes"):
        make_tool_parser("functionary")


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
        # Qwen3-Coder / Qwen3.5 and GLM-4.5+ templates also write `<tool_call>`: their own markers win over Hermes
        ("{{ '<tool_call>\\n<function=f>\\n<parameter=p>\\n' }}{{ '<|im_start|>' }}", [], "qwen3_moe", "qwen3_coder"),
        ("{{ '<tool_call>{name}\\n<arg_key>k</arg_key>\\n<arg_value>v</arg_value>' }}", [], "glm4_moe", "glm45"),
        (None, ["<tool_call>", "<arg_key>"], "llama", "glm45"),
        (None, [], "glm4_moe", "glm45"),
        ("{{ '[AVAILABLE_TOOLS]' }}{{ '[TOOL_CALLS]' }}", [], "llama", "mistral"),
        (None, ["[INST]", "[TOOL_CALLS]"], "llama", "mistral"),
        (None, [], "mistral", "mistral"),  # by the family (a name it goes by: the server sends ModelConfig.architecture)
    ],
)
def test_detect(template: str | None, special: list[str], arch: str, expected: str) -> None:
    assert detect_tool_parser(chat_template=template, special_tokens=special, architecture=arch) == expected


def test_only_harmony_and_gemma4_need_special_tokens() -> None:
    assert [n for n, cls in TOOL_PARSERS.items() if cls.needs_special_tokens] == ["gemma4", "harmony"]
