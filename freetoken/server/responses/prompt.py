"""A Responses request's prompt: the conversation rendered, and for a chained request
(`previous_response_id`) the earlier turn's exact tokens spliced in so the prefix cache hits.

Owns `build_prompt` (a `Prompt` whose `text` is the rendered conversation, generation prompt
included, which the store keeps for the next turn). Without an earlier turn it is the core's `render_chat` (template,
tools, message boundaries). With one, the earlier prompt's ids and the ids the model sampled are
reused as they are: re-tokenizing model output need not give back the ids the model sampled (nor
the ones the engine cached; random bytes, special tokens), and this way the whole earlier
conversation is a cache hit. Where the earlier output was plain text (no calls, no reasoning), the
conversation is rendered with that message's content replaced by a marker; where the render starts
with the earlier prompt and the marker, the prompt is the earlier prompt's ids + the output's ids
+ the tokens of what follows the marker (less the end-of-turn token the model already wrote).
Otherwise, where the render starts with the earlier prompt + the output decoded with special
tokens, the same splice is made; failing that the earlier prompt alone is spliced, and failing that
the text is tokenized plainly. System messages (instructions, developer messages) are fitted to
the template by `fold_system_messages`, as on chat.
"""

from __future__ import annotations

from typing import Any

from freetoken.server.core.chat_prompt import Prompt, render_chat
from freetoken.server.core.system_messages import fold_system_messages
from freetoken.server.core.tool_calling import ToolCalling
from freetoken.server.responses.store import StoredResponse
from freetoken.tokenizer import ChatTemplateError, NoChatTemplate, Tokenizer

MARKER = "\x00ft-earlier-output\x00"  # stands for the earlier output's content in a render


def build_prompt(
    tokenizer: Tokenizer,
    tooling: ToolCalling,
    messages: list[dict[str, Any]],
    prior: StoredResponse | None,
    output_at: int | None = None,
) -> Prompt:
    """`output_at`: the index in `messages` of the earlier turn's plain-text output message."""
    text = _render(tokenizer, tooling, messages)
    if prior is not None and text is not None:
        spliced = None
        if output_at is not None:
            marked = [*messages[:output_at], {**messages[output_at], "content": MARKER}, *messages[output_at + 1 :]]
            spliced = _splice_marked(tokenizer, text, _render(tokenizer, tooling, marked), prior)
        if spliced is None:
            spliced = _splice_text(tokenizer, text, prior)
        if spliced is not None:
            return spliced
    template_messages, tools = tooling.template_inputs(messages)
    ids, boundaries = render_chat(
        tokenizer, template_messages, tools, tooling.template_context()
    )  # raises the template's 400
    return Prompt(ids, boundaries, text or "")


def _render(tokenizer: Tokenizer, tooling: ToolCalling, messages: list[dict[str, Any]]) -> str | None:
    """The text `render_chat` renders for `messages` (system messages fitted, template variables set)."""
    template_messages, tools = tooling.template_inputs(messages)
    try:
        return tokenizer.apply_chat_template(
            fold_system_messages(tokenizer, template_messages),
            add_generation_prompt=True,
            tools=tools,
            extra_context=tooling.template_context(),
        )
    except (ChatTemplateError, NoChatTemplate):
        return None


def _splice_marked(tokenizer: Tokenizer, text: str, marked: str | None, prior: StoredResponse) -> Prompt | None:
    head = prior.prompt_text + MARKER
    if marked is None or not prior.prompt_text or not marked.startswith(head):
        return None
    rest = marked[len(head) :]
    output = list(prior.output_ids)
    if output and output[-1] in tokenizer.stop_ids:
        end = tokenizer.decode(output[-1:], skip_special_tokens=False)
        if not rest.startswith(end):
            return None  # the template closes the turn with another token than the model did
        rest = rest[len(end) :]
    return _joined(tokenizer, text, prior, [*prior.prompt_ids, *output], rest)


def _splice_text(tokenizer: Tokenizer, text: str, prior: StoredResponse) -> Prompt | None:
    output_text = tokenizer.decode(list(prior.output_ids), skip_special_tokens=False)
    candidates = [
        (prior.prompt_text + output_text, [*prior.prompt_ids, *prior.output_ids]),
        (prior.prompt_text, list(prior.prompt_ids)),
    ]
    for head_text, head_ids in candidates:
        if head_text and text.startswith(head_text):
            return _joined(tokenizer, text, prior, head_ids, text[len(head_text) :])
    return None


def _joined(tokenizer: Tokenizer, text: str, prior: StoredResponse, head_ids: list[int], rest: str) -> Prompt | None:
    if not rest:
        return None
    ids = head_ids + list(tokenizer.backend.encode(rest, add_special_tokens=False).ids)
    marks = {*prior.boundaries, len(prior.prompt_ids), len(head_ids)}
    return Prompt(ids, tuple(sorted(b for b in marks if 0 < b < len(ids))), text)
