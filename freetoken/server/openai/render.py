"""`POST /v1/chat/completions/render` and `POST /v1/completions/render`: a request's prompt ids.

Owns vLLM's two render routes. vllm-router's `cache_aware` policy calls them on every worker
before it routes a request, and keys its prefix tree on the token ids (without them it routes
with no prefix knowledge; docs/scale-out.md). The body is the inference route's, checked the
same way; the answer is the ids that route would prefill -- the chat template with its tool
prompt, or each completions prompt -- in vLLM's shapes (chat: one object, completions: a list,
one per prompt). Nothing runs on the engine; it only needs the engine's vocabulary size, so it
answers 503 while the engine is loading.
"""

from __future__ import annotations

import uuid
from typing import Any

from freetoken.server.context import ServingContext
from freetoken.server.core.tool_calling import openai_tool_options, with_tools
from freetoken.server.openai.completions import prompt_ids
from freetoken.server.openai.protocol import ChatCompletionRequest, CompletionRequest


def render_chat_request(ctx: ServingContext, req: ChatCompletionRequest) -> dict[str, Any]:
    ctx.check_model(req.model)
    req.check_messages()
    ctx.ready_info()
    options = openai_tool_options(req.tools, req.tool_choice, req.parallel_tool_calls)
    _, prompt = with_tools(ctx, options, [m.for_template() for m in req.messages])
    return {"request_id": f"chatcmpl-{uuid.uuid4().hex}", "model": ctx.served_name, "token_ids": prompt.ids}


def render_completion_request(ctx: ServingContext, req: CompletionRequest) -> list[dict[str, Any]]:
    ctx.check_model(req.model)
    info = ctx.ready_info()
    request_id = f"cmpl-{uuid.uuid4().hex}"
    return [
        {"request_id": request_id, "model": ctx.served_name, "token_ids": ids}
        for ids in prompt_ids(ctx.tokenizer, req.prompt, info.vocab_size)
    ]
