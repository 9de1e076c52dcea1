"""A conversation through the model's chat template: prompt ids and message boundaries.

Owns `render_chat`, the one rendering every chat-shaped route uses (`/v1/chat/completions`,
`/v1/responses`, `/v1/messages` and its `count_tokens`, `/v1/tokenize`, the render routes): the
model's template, the built-in one for its architecture, or `--chat-template`; a model with none
is a 400 that says so. The message boundaries handed to the engine are the token offsets where
each message ends, so the prefix cache keeps their windows. Messages come in the chat-template
form (OpenAI-style dicts, tools already fitted by `ToolCalling.template_inputs`); no wire shape is
known here. Also `Prompt`, a rendered prompt as the request recipe carries it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from freetoken.server.core.system_messages import fold_system_messages
from freetoken.server.errors import bad_request
from freetoken.tokenizer import ChatTemplateError, NoChatTemplate, Tokenizer

MAX_BOUNDARY_MESSAGES = 256  # past this many messages, boundaries are not computed (quadratic renders)
MAX_BOUNDARY_CHARS = 1 << 27  # nor past this many characters rendered in all (messages x prompt length)


@dataclass(frozen=True)
class Prompt:
    """A prompt ready for the engine: its ids, the token offsets where its messages end (none for
    a raw prompt), and the rendered text where a route keeps it (Responses, for the next turn)."""

    ids: list[int]
    boundaries: tuple[int, ...] = ()
    text: str = ""


def render_chat(
    tokenizer: Tokenizer,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    extra_context: dict[str, Any] | None = None,
) -> tuple[list[int], tuple[int, ...]]:
    """Prompt ids of the conversation and the token offset where each message ends (where that is
    a token edge of the full prompt; a template that renders a prefix differently gives none).
    System messages past the start are fitted to the template first (`fold_system_messages`);
    `extra_context` adds template variables (`ToolCalling.template_context`)."""
    messages = fold_system_messages(tokenizer, messages)
    try:
        text = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tools=tools, extra_context=extra_context
        )
    except NoChatTemplate:
        raise bad_request(
            "this model has no chat template and none is built in for its architecture; start the server with "
            "--chat-template FILE, or use /v1/completions",
            param="messages",
            code="no_chat_template",
        ) from None
    except ChatTemplateError as err:
        raise bad_request(f"the chat template refused these messages: {err}", param="messages") from None
    encoding = tokenizer.backend.encode(text, add_special_tokens=False)
    ids = list(encoding.ids)
    if len(messages) > MAX_BOUNDARY_MESSAGES or len(messages) * len(text) > MAX_BOUNDARY_CHARS:
        return ids, ()
    token_end = {end: i + 1 for i, (_, end) in enumerate(encoding.offsets)}
    boundaries: list[int] = []
    for k in range(1, len(messages) + 1):
        try:
            prefix = tokenizer.apply_chat_template(
                messages[:k], add_generation_prompt=False, tools=tools, extra_context=extra_context
            )
        except (ChatTemplateError, NoChatTemplate):
            continue
        if text.startswith(prefix) and len(prefix) in token_end:
            offset = token_end[len(prefix)]
            if offset < len(ids) and (not boundaries or offset > boundaries[-1]):
                boundaries.append(offset)
    return ids, tuple(boundaries)
