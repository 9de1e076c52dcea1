"""System messages past the start of a conversation (Claude Code's mid-conversation reminders,
Anthropic `system` role messages, OpenAI `developer` turns late in a chat), fitted to the template.

Owns `fold_system_messages`: when the model's template renders a system message after other turns
(ChatML does), the conversation is left as sent; when it refuses one there or drops it (Gemma's
alternating turns, templates that read only `messages[0]`), the leading system messages become one
and each later one is merged into the user turn that follows it (or the one before it, or becomes a
user turn of its own). Then, where the template refuses two user turns in a row (Gemma's), each
run of consecutive user turns with text content is merged into one (Codex sends its environment
context and the prompt as two user messages). It renders nothing else and knows no wire format.
"""

from __future__ import annotations

from itertools import pairwise
from typing import Any

from freetoken.tokenizer import ChatTemplateError, NoChatTemplate, Tokenizer

_PROBE = "ft_probe_system_m4z"


def renders_late_system(tokenizer: Tokenizer) -> bool:
    """Whether the template renders a system message that comes after a user and assistant turn."""
    probe = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "system", "content": _PROBE},
        {"role": "user", "content": "c"},
    ]
    try:
        return _PROBE in tokenizer.apply_chat_template(probe, add_generation_prompt=True)
    except (ChatTemplateError, NoChatTemplate):
        return False


def renders_repeated_user(tokenizer: Tokenizer) -> bool:
    """Whether the template renders two user turns in a row."""
    probe = [{"role": "user", "content": "a"}, {"role": "user", "content": _PROBE}]
    try:
        return _PROBE in tokenizer.apply_chat_template(probe, add_generation_prompt=True)
    except (ChatTemplateError, NoChatTemplate):
        return False


def _merge_repeated_users(tokenizer: Tokenizer, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    def mergeable(m: dict[str, Any]) -> bool:
        return m.get("role") == "user" and isinstance(m.get("content"), str)

    repeated = any(mergeable(a) and mergeable(b) for a, b in pairwise(messages))
    if not repeated or renders_repeated_user(tokenizer):
        return messages
    out: list[dict[str, Any]] = []
    for message in messages:
        if out and mergeable(out[-1]) and mergeable(message):
            out[-1] = {**out[-1], "content": f"{out[-1]['content']}\n\n{message['content']}"}
        else:
            out.append(message)
    return out


def _text(message: dict[str, Any]) -> str:
    content = message.get("content")
    return content if isinstance(content, str) else ""


def fold_system_messages(tokenizer: Tokenizer, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation with its system messages where the template can render them."""
    lead = 0
    while lead < len(messages) and messages[lead].get("role") == "system":
        lead += 1
    late = [i for i in range(lead, len(messages)) if messages[i].get("role") == "system"]
    if (not late and lead <= 1) or renders_late_system(tokenizer):
        return _merge_repeated_users(tokenizer, messages)
    out: list[dict[str, Any]] = []
    if lead:
        out.append({"role": "system", "content": "\n\n".join(_text(m) for m in messages[:lead])})
    carried: list[str] = []  # late system text waiting for the next user turn
    for message in messages[lead:]:
        if message.get("role") == "system":
            carried.append(_text(message))
            continue
        if carried and message.get("role") == "user":
            message = {**message, "content": "\n\n".join([*carried, _text(message)])}
            carried = []
        elif carried and out and out[-1].get("role") == "user":
            out[-1] = {**out[-1], "content": "\n\n".join([_text(out[-1]), *carried])}
            carried = []
        out.append(message)
    if carried:
        if out and out[-1].get("role") == "user":
            out[-1] = {**out[-1], "content": "\n\n".join([_text(out[-1]), *carried])}
        else:
            out.append({"role": "user", "content": "\n\n".join(carried)})
    return _merge_repeated_users(tokenizer, out)
