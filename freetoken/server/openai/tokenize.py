"""`POST /v1/tokenize` and `POST /v1/detokenize`: the server's tokenizer over HTTP.

Owns the two request schemas and their answers. Tokenize takes either a `prompt` string (encoded
as `/v1/completions` encodes it, BOS included unless `add_special_tokens` is false) or chat
`messages` (rendered as `/v1/chat/completions` renders them, so the count is the prompt that
request would run); detokenize decodes ids (special tokens kept, so a round trip is exact). Bad
input is a 400 naming the field. It runs in the API process only and never reaches the engine.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import anyio.to_thread
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict

from freetoken.server.context import ServingContext
from freetoken.server.core.chat_prompt import render_chat
from freetoken.server.core.tool_calling import ToolCalling, openai_tool_options
from freetoken.server.errors import bad_request
from freetoken.server.openai.protocol import ChatMessage
from freetoken.server.operations.request_log import RequestLine
from freetoken.tokenizer import ChatTemplateError, NoChatTemplate

MAX_DETOKENIZE_IDS = 1_000_000


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Any] | None = None  # messages only: counted as the chat route renders them
    add_generation_prompt: bool | None = None  # messages only; default true
    add_special_tokens: bool | None = None  # prompt only; default true


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


def _chat_ids(
    ctx: ServingContext, messages: list[dict[str, Any]], tools: list[Any] | None, add_generation_prompt: bool
) -> list[int]:
    # Earlier tool calls, tool results and tool prompts are rendered as the chat route does.
    messages, template_tools = ToolCalling(ctx, openai_tool_options(tools, None, None)).template_inputs(messages)
    if add_generation_prompt:
        return render_chat(ctx.tokenizer, messages, template_tools)[0]  # exactly the chat route's prompt
    try:
        text = ctx.tokenizer.apply_chat_template(messages, add_generation_prompt=False, tools=template_tools)
    except NoChatTemplate:
        raise bad_request(
            "this model has no chat template; tokenize a prompt instead", param="messages", code="no_chat_template"
        ) from None
    except ChatTemplateError as err:
        raise bad_request(f"the chat template refused these messages: {err}", param="messages") from None
    return ctx.tokenizer.encode(text, add_special_tokens=False)


async def tokenize(ctx: ServingContext, req: TokenizeRequest, line: RequestLine | None = None) -> Response:
    """The prompt's ids and their count (also the request's log line's, in `line`)."""
    if req.model is not None:
        ctx.check_model(req.model)
    if (req.prompt is None) == (req.messages is None):
        raise bad_request(
            "send exactly one of 'prompt' and 'messages'", param="prompt" if req.prompt is None else "messages"
        )
    if req.prompt is not None:
        if req.tools is not None:
            raise bad_request("tools applies to 'messages' only", param="tools")
        if req.add_generation_prompt is not None:
            raise bad_request("add_generation_prompt applies to 'messages' only", param="add_generation_prompt")
        add_special = True if req.add_special_tokens is None else req.add_special_tokens
        ids = await anyio.to_thread.run_sync(partial(ctx.tokenizer.encode, req.prompt, add_special_tokens=add_special))
    else:
        if req.add_special_tokens is not None:
            raise bad_request(
                "add_special_tokens applies to 'prompt' only (templates write their own)", param="add_special_tokens"
            )
        if not req.messages:
            raise bad_request("messages must not be empty", param="messages")
        add_generation = True if req.add_generation_prompt is None else req.add_generation_prompt
        ids = await anyio.to_thread.run_sync(
            _chat_ids, ctx, [m.for_template() for m in req.messages], req.tools, add_generation
        )
    if line is not None:
        line.prompt_tokens = len(ids)
    info = ctx.client.info
    body = {"tokens": ids, "count": len(ids), "max_model_len": None if info is None else info.context_length}
    return await anyio.to_thread.run_sync(JSONResponse, body)  # millions of ids take a while to write


async def detokenize(ctx: ServingContext, req: DetokenizeRequest) -> Response:
    if req.model is not None:
        ctx.check_model(req.model)
    if len(req.tokens) > MAX_DETOKENIZE_IDS:
        raise bad_request(f"at most {MAX_DETOKENIZE_IDS} tokens, got {len(req.tokens)}", param="tokens")
    vocab = ctx.tokenizer.vocab_size
    for i, token in enumerate(req.tokens):
        if not 0 <= token < vocab:
            raise bad_request(
                f"token id {token} is outside the vocabulary (0..{vocab - 1})",
                param=f"tokens[{i}]",
                code="invalid_token_id",
            )
    return JSONResponse({"prompt": ctx.tokenizer.decode(req.tokens)})
