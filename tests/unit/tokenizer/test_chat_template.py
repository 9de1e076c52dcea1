"""Chat template rendering: the built-in Gemma 3 format, HF-compatible environment, typed errors."""

from __future__ import annotations

import json
from datetime import datetime

import pytest

from freetoken.errors import FreeTokenError
from freetoken.tokenizer import ChatTemplateError, NoChatTemplate, Tokenizer
from freetoken.families.gemma3 import CHAT_TEMPLATE as GEMMA3_CHAT_TEMPLATE
from freetoken.tokenizer.chat_template import ChatTemplate, builtin_chat_template

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "  What is 2+2? "},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And 3+3?"},
]


def test_gemma3_builtin_folds_system_into_first_user_turn() -> None:
    text = ChatTemplate(GEMMA3_CHAT_TEMPLATE).render(CONVERSATION, add_generation_prompt=True, bos_token="<bos>")
    assert text == (
        "<bos><start_of_turn>user\nYou are terse.\n\nWhat is 2+2?<end_of_turn>\n"
        "<start_of_turn>model\n4<end_of_turn>\n"
        "<start_of_turn>user\nAnd 3+3?<end_of_turn>\n"
        "<start_of_turn>model\n"
    )


def test_gemma3_builtin_without_system_and_without_generation_prompt() -> None:
    messages = [{"role": "user", "content": [{"type": "text", "text": "hi "}]}, {"role": "assistant", "content": "yo"}]
    text = ChatTemplate(GEMMA3_CHAT_TEMPLATE).render(messages, add_generation_prompt=False, bos_token="<bos>")
    assert text == "<bos><start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\nyo<end_of_turn>\n"


def test_gemma3_builtin_refuses_non_alternating_roles() -> None:
    messages = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(ChatTemplateError, match="alternate"):
        ChatTemplate(GEMMA3_CHAT_TEMPLATE).render(messages, add_generation_prompt=True)


def test_builtin_only_for_gemma3() -> None:
    assert builtin_chat_template("gemma3") == GEMMA3_CHAT_TEMPLATE
    assert builtin_chat_template("gemma3_text") == GEMMA3_CHAT_TEMPLATE
    assert builtin_chat_template("llama") is None


def test_no_chat_template_is_a_typed_error(tiny_llama_spm: Tokenizer) -> None:
    assert tiny_llama_spm.chat_template is None
    with pytest.raises(NoChatTemplate) as info:
        tiny_llama_spm.apply_chat_template([{"role": "user", "content": "hi"}])
    assert isinstance(info.value, FreeTokenError) and "no chat template" in str(info.value)


def test_gemma_tokenizer_uses_the_builtin_and_encodes_without_a_second_bos(tiny_spm: Tokenizer) -> None:
    ids = tiny_spm.encode_chat([{"role": "user", "content": "ab"}])
    assert ids[:2] == [2, 4] and ids.count(2) == 1
    assert tiny_spm.decode(ids) == "<bos><start_of_turn>user\nab<end_of_turn>\n<start_of_turn>model\n"


def test_environment_matches_hugging_face() -> None:
    source = (
        "{% for m in messages %}\n"
        "  {{ m['content'] | tojson }}\n"
        "{% endfor %}"
        "{{ tools | tojson(indent=2) }}|{{ strftime_now('%Y') }}|{{ bos_token }}{{ eos_token }}|{{ flag }}"
        "{% generation %}G{% endgeneration %}"
        "{% for x in [1, 2, 3] %}{% if x == 2 %}{% break %}{% endif %}{{ x }}{% endfor %}"
    )
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    text = ChatTemplate(source).render(
        [{"role": "user", "content": "<b>héllo</b> & \"q\""}],
        add_generation_prompt=False,
        tools=tools,
        bos_token="<s>",
        eos_token="</s>",
        extra_context={"flag": True},
    )
    # trim_blocks + lstrip_blocks: the block lines leave no whitespace; tojson does not escape HTML
    # or non-ASCII
    assert text.startswith('  "<b>héllo</b> & \\"q\\""\n' + json.dumps(tools, indent=2) + "|")
    assert text.endswith(f"|{datetime.now().year}|<s></s>|TrueG1")


def test_raise_exception_and_bad_syntax_are_typed() -> None:
    with pytest.raises(ChatTemplateError, match="nope"):
        ChatTemplate("{{ raise_exception('nope') }}").render([], add_generation_prompt=True)
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate("{% for %}")


def test_sandbox_blocks_attribute_escapes() -> None:
    with pytest.raises(ChatTemplateError, match="unsafe"):
        ChatTemplate("{{ messages.__class__.__subclasses__() }}").render([], add_generation_prompt=True)
