"""Late system messages fitted to the template: kept in place where it renders them (ChatML),
merged into the next user turn (or the one before, or a user turn of their own) where it refuses
them (Gemma 3's alternating turns), leading ones joined into one."""

from __future__ import annotations

from typing import Any

from freetoken.server.core.system_messages import fold_system_messages, renders_late_system
from freetoken.tokenizer import Tokenizer
from freetoken.families.gemma3 import CHAT_TEMPLATE as GEMMA3_CHAT_TEMPLATE
from freetoken.tokenizer.testing import CHATML_TEMPLATE

CONVERSATION: list[dict[str, Any]] = [
    {"role": "system", "content": "S1"},
    {"role": "system", "content": "S2"},
    {"role": "user", "content": "U1"},
    {"role": "assistant", "content": "A1"},
    {"role": "system", "content": "late"},
    {"role": "user", "content": "U2"},
    {"role": "assistant", "content": "A2"},
    {"role": "system", "content": "last"},
]


def tokenizer(template: str) -> Tokenizer:
    from tokenizers import Tokenizer as Backend
    from tokenizers import models

    return Tokenizer(Backend(models.BPE()), bos_id=None, eos_id=None, chat_template=template)


def test_chatml_keeps_them_in_place() -> None:
    tok = tokenizer(CHATML_TEMPLATE)
    assert renders_late_system(tok)
    assert fold_system_messages(tok, CONVERSATION) == CONVERSATION


def test_gemma_gets_them_folded_into_user_turns() -> None:
    tok = tokenizer(GEMMA3_CHAT_TEMPLATE)
    assert not renders_late_system(tok)
    folded = fold_system_messages(tok, CONVERSATION)
    assert folded == [
        {"role": "system", "content": "S1\n\nS2"},
        {"role": "user", "content": "U1"},
        {"role": "assistant", "content": "A1"},
        {"role": "user", "content": "late\n\nU2"},
        {"role": "assistant", "content": "A2"},
        {"role": "user", "content": "last"},
    ]
    text = tok.apply_chat_template(folded, add_generation_prompt=True)  # the template takes the result
    assert "late\n\nU2" in text and text.index("S1") < text.index("U1")


# Codex's first request: two developer messages, then its environment context and the prompt as
# two user messages in a row.
CODEX_SHAPE: list[dict[str, Any]] = [
    {"role": "system", "content": "D1"},
    {"role": "system", "content": "D2"},
    {"role": "user", "content": "env"},
    {"role": "user", "content": "prompt"},
]


def test_gemma_gets_repeated_user_turns_merged() -> None:
    tok = tokenizer(GEMMA3_CHAT_TEMPLATE)
    folded = fold_system_messages(tok, CODEX_SHAPE)
    assert folded == [{"role": "system", "content": "D1\n\nD2"}, {"role": "user", "content": "env\n\nprompt"}]
    assert "env\n\nprompt" in tok.apply_chat_template(folded, add_generation_prompt=True)
    user_turns = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    assert fold_system_messages(tok, user_turns) == [{"role": "user", "content": "a\n\nb"}]


def test_chatml_keeps_repeated_user_turns() -> None:
    tok = tokenizer(CHATML_TEMPLATE)
    assert fold_system_messages(tok, CODEX_SHAPE[2:]) == CODEX_SHAPE[2:]
