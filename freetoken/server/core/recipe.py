"""The one request recipe: a protocol-neutral request in, a request ready to run out.

Owns `ChatInput` (a chat request in no protocol's shape, its values already checked by its
protocol's request model), `PromptInput` (raw prompts: `/v1/completions`), `Prepared` /
`PreparedChat`, and the two steps that make them, which every generation route runs in the same
order after its protocol has translated and checked the request:

1. the engine's model facts (503 while it loads or is down);
2. the prompt, off the event loop: a chat request's tool handling and reasoning fitted to the
   template and rendered with its message boundaries (`tool_calling.with_tools`), or each raw
   prompt tokenized by the protocol's own function;
3. the context check (prompt + max_tokens past the context is a 400, never clamped; a chat
   request without max_tokens gets the rest of the context);
4. the final sampling parameters: max_tokens, the checks that need the vocabulary, and what the
   tools and reasoning need (a forced-call grammar, special tokens kept, a reasoning budget);
5. the admission limit (429), and the retention pins placed at the message boundaries.

The sampling parameters are built and range-checked once, by the protocol, before any of this.
Running a prepared request is run.py's; the bodies are the protocols'. Nothing here knows a
wire shape.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import anyio.to_thread

from freetoken.request import SamplingParams
from freetoken.server.context import ServingContext
from freetoken.server.core.chat_prompt import Prompt
from freetoken.server.core.limits import check_context
from freetoken.server.core.pins import PinMarks, Pins
from freetoken.server.core.tool_calling import Renderer, ToolCalling, ToolOptions, render_prompt, with_tools
from freetoken.server.process.messages import Ready
from freetoken.tokenizer import Tokenizer

VocabCheck = Callable[[int], object]  # raises a 400 naming the field when an id is past the vocabulary size


@dataclass(frozen=True, kw_only=True)
class ChatInput:
    """A chat request as the recipe takes it. `params` are range-checked, their `max_tokens` a
    placeholder until the prompt is known; `max_tokens` None means the rest of the context.
    `prompt_param` / `max_param` are the request's names for the fields a context error names."""

    messages: list[dict[str, Any]]  # chat-template messages (OpenAI-style dicts)
    params: SamplingParams
    max_tokens: int | None = None
    tools: ToolOptions = field(default_factory=ToolOptions)
    thinking: bool | None = None  # the request's say on reasoning (None: the template's default)
    reasoning_budget: int | None = None  # at most this many reasoning tokens
    pins: PinMarks = field(default_factory=PinMarks)
    num_choices: int = 1
    include_stop: bool = False  # a matched stop string stays at the end of the text
    prompt_param: str = "messages"
    max_param: str = "max_tokens"
    check_vocab: VocabCheck | None = None
    render: Renderer = render_prompt  # Responses splices an earlier turn's exact tokens in
    unset: frozenset[str] = frozenset()  # sampling fields the request left out: the model's defaults apply


@dataclass(frozen=True, kw_only=True)
class PromptInput:
    """Raw prompts as the recipe takes them: `tokenize(tokenizer, vocab_size)` gives each
    prompt's ids (400s for an empty prompt or an id past the vocabulary)."""

    tokenize: Callable[[Tokenizer, int], list[list[int]]]
    params: SamplingParams
    max_tokens: int
    num_choices: int = 1
    include_stop: bool = False
    check_vocab: VocabCheck | None = None
    unset: frozenset[str] = frozenset()  # sampling fields the request left out: the model's defaults apply


@dataclass(frozen=True, kw_only=True)
class Prepared:
    """A request ready to run: each prompt gets `num_choices` choices with `params`."""

    prompts: tuple[Prompt, ...]
    params: SamplingParams
    num_choices: int = 1
    include_stop: bool = False
    pins: Pins = ()


@dataclass(frozen=True, kw_only=True)
class PreparedChat(Prepared):
    """A chat request ready to run, with the tool handling that parses its output."""

    tooling: ToolCalling

    @property
    def prompt(self) -> Prompt:
        return self.prompts[0]


async def prepare_chat(ctx: ServingContext, chat: ChatInput) -> PreparedChat:
    info = ctx.ready_info()
    tooling, prompt = await anyio.to_thread.run_sync(  # template + tokenizer: off the event loop
        partial(with_tools, ctx, chat.tools, chat.messages, thinking=chat.thinking, render=chat.render)
    )
    max_tokens = chat.max_tokens if chat.max_tokens is not None else info.context_length - len(prompt.ids)
    check_context(
        len(prompt.ids),
        max(max_tokens, 1),
        info.context_length,
        prompt_param=chat.prompt_param,
        max_param=chat.max_param,
    )
    params = ctx.sampling_defaults.apply(chat.params, chat.unset)
    params = tooling.sampling(
        _sized(params, max_tokens, chat.check_vocab, info), reasoning_budget=chat.reasoning_budget
    )
    ctx.check_capacity(chat.num_choices)
    return PreparedChat(
        prompts=(prompt,),
        params=params,
        num_choices=chat.num_choices,
        include_stop=chat.include_stop,
        pins=chat.pins.at(prompt.boundaries),
        tooling=tooling,
    )


async def prepare_prompts(ctx: ServingContext, raw: PromptInput) -> Prepared:
    info = ctx.ready_info()
    prompts = await anyio.to_thread.run_sync(raw.tokenize, ctx.tokenizer, info.vocab_size)  # off the event loop
    for ids in prompts:
        check_context(len(ids), raw.max_tokens, info.context_length, prompt_param="prompt", max_param="max_tokens")
    params = _sized(ctx.sampling_defaults.apply(raw.params, raw.unset), raw.max_tokens, raw.check_vocab, info)
    ctx.check_capacity(len(prompts) * raw.num_choices)
    return Prepared(
        prompts=tuple(Prompt(ids) for ids in prompts),
        params=params,
        num_choices=raw.num_choices,
        include_stop=raw.include_stop,
    )


def _sized(params: SamplingParams, max_tokens: int, check_vocab: VocabCheck | None, info: Ready) -> SamplingParams:
    """`params` with their final max_tokens, once what depends on the vocabulary is checked."""
    if check_vocab is not None:
        check_vocab(info.vocab_size)
    return replace(params, max_tokens=max_tokens)
