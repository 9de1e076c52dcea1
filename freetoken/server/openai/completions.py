"""`POST /v1/completions`: raw prompts (a string, strings, token ids, lists of token ids).

Owns `completion_input` (a CompletionRequest as the recipe's `PromptInput`: `prompt_ids`, the
tokenization with its vocabulary checks, and the range-checked sampling parameters) and the
OpenAI `text_completion` bodies and stream chunks, echo and legacy logprobs included. The context
checks, `n` with its per-choice seeds and the admission limit are the recipe's (core/recipe.py,
core/run.py).
"""

from __future__ import annotations

import time
import uuid
from functools import partial
from typing import Any

from fastapi.responses import JSONResponse, Response

from freetoken.server.context import ServingContext
from freetoken.server.core.generation import ChoiceResult, ChoiceSpec, Clock, Piece
from freetoken.server.core.logprobs import wire_logprob
from freetoken.server.core.recipe import PromptInput, prepare_prompts
from freetoken.server.core.run import start
from freetoken.server.core.streaming import DataFraming, Tally, sse_response
from freetoken.server.errors import bad_request
from freetoken.server.openai.protocol import CompletionRequest, logit_bias_pairs
from freetoken.server.sampling_defaults import left_out
from freetoken.tokenizer import Tokenizer

ENDPOINT = "completions"
MAX_PROMPTS = 64


def prompt_ids(
    tokenizer: Tokenizer, prompt: str | list[str] | list[int] | list[list[int]], vocab_size: int
) -> list[list[int]]:
    """The token ids of each prompt; 400 for an empty prompt or an id outside the vocabulary."""
    if isinstance(prompt, str):
        batch: list[list[int]] = [tokenizer.encode(prompt)]
    elif not prompt:
        raise bad_request("prompt must not be empty", param="prompt")
    elif isinstance(prompt[0], str):
        batch = [tokenizer.encode(p) for p in prompt]  # type: ignore[arg-type]
    elif isinstance(prompt[0], int):
        batch = [list(prompt)]  # type: ignore[arg-type]
    else:
        batch = [list(p) for p in prompt]  # type: ignore[arg-type]
    if len(batch) > MAX_PROMPTS:
        raise bad_request(f"at most {MAX_PROMPTS} prompts per request, got {len(batch)}", param="prompt")
    for ids in batch:
        if not ids:
            raise bad_request("prompt must not be empty", param="prompt")
        bad = [i for i in ids if not 0 <= i < vocab_size]
        if bad:
            raise bad_request(
                f"token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})",
                param="prompt",
                code="invalid_token_id",
            )
    return batch


def legacy_logprobs(tokenizer: Tokenizer, entries: list[Any], offset: int) -> dict[str, Any]:
    """OpenAI's completions logprobs: tokens, token_logprobs, top_logprobs, text_offset."""
    out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for entry in entries:
        if entry is None:
            continue
        token_id, logprob, top = entry[0], entry[1], entry[2] if len(entry) > 2 else []
        text = tokenizer.decode([token_id])
        out["tokens"].append(text)
        out["token_logprobs"].append(wire_logprob(logprob))
        out["top_logprobs"].append({tokenizer.decode([t]): wire_logprob(lp) for t, lp in top})
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def _echo_logprobs(tokenizer: Tokenizer, ids: list[int], prompt_lps: list[Any] | None) -> dict[str, Any]:
    """The prompt's part of `logprobs` under `echo`: the first token has no logprob."""
    entries = prompt_lps or []
    out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    offset = 0
    for i, token_id in enumerate(ids):
        entry = entries[i] if i < len(entries) else None
        text = tokenizer.decode([token_id])
        out["tokens"].append(text)
        out["token_logprobs"].append(None if entry is None else wire_logprob(entry[1]))
        out["top_logprobs"].append(
            None if entry is None else {tokenizer.decode([t]): wire_logprob(lp) for t, lp in entry[2]}
        )
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def _merge_logprobs(head: dict[str, Any], tail: dict[str, Any]) -> dict[str, Any]:
    return {key: head[key] + tail[key] for key in head}


def completion_input(req: CompletionRequest) -> PromptInput:
    """The request in the core's terms; a 400 naming the field for a value it cannot take."""
    max_tokens = req.requested_max_tokens()
    logprobs = req.checked_logprobs()
    prompt_logprobs = logprobs if req.echo and logprobs is not None else None
    return PromptInput(
        tokenize=lambda tokenizer, vocab_size: prompt_ids(tokenizer, req.prompt, vocab_size),
        params=req.sampling_params(max_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs),
        max_tokens=max_tokens,
        num_choices=req.num_choices,
        include_stop=bool(req.no_stop_trim),
        check_vocab=partial(logit_bias_pairs, req.logit_bias),
        unset=left_out(req),
    )


def echo_texts(req: CompletionRequest, tokenizer: Tokenizer, prompts: list[list[int]]) -> list[str]:
    """What `echo` puts before each prompt's choices: the prompt as sent (text) or decoded (ids)."""
    if not req.echo:
        return ["" for _ in prompts]
    if isinstance(req.prompt, str):
        return [req.prompt]
    if req.prompt and isinstance(req.prompt[0], str):
        return list(req.prompt)  # type: ignore[arg-type]
    return [tokenizer.decode(ids) for ids in prompts]


async def create_completion(ctx: ServingContext, req: CompletionRequest, request_id: str) -> Response:
    clock = Clock()
    prepared = await prepare_prompts(ctx, completion_input(req))
    response_id = f"cmpl-{uuid.uuid4().hex}"
    run = start(ctx, ENDPOINT, prepared, request_id, response_id, clock)
    head = {"id": response_id, "object": "text_completion", "created": int(time.time()), "model": ctx.served_name}
    shapes = CompletionShapes(
        ctx, head, run.specs, echo_texts(req, ctx.tokenizer, [p.ids for p in prepared.prompts]), req
    )
    if not req.stream:
        results = await run.collect()
        choices = [shapes.choice(spec, res) for spec, res in zip(run.specs, results)]
        return JSONResponse({**head, "choices": choices, "usage": run.tally.usage(ctx.config.enable_cache_report)})
    first = await run.first()
    return sse_response(
        run.events(first, DataFraming([], shapes.chunks, shapes.usage_chunk if req.include_usage else None))
    )


class CompletionShapes:
    """The `text_completion` choices and stream chunks of one request: each choice's text after
    its prompt's echo, with legacy logprobs (the echoed prompt's first, under `echo`) when asked."""

    def __init__(
        self,
        ctx: ServingContext,
        head: dict[str, Any],
        specs: list[ChoiceSpec],
        echoes: list[str],
        req: CompletionRequest,
    ) -> None:
        self._ctx = ctx
        self._head = head
        self._specs = specs
        self._n = req.num_choices
        self._echoes = echoes
        self._echo = bool(req.echo)
        self._logprobs = req.logprobs is not None
        self._include_usage = req.include_usage
        self._offsets = [len(echoes[s.index // self._n]) for s in specs]
        self._echoed: set[int] = set()

    def choice(self, spec: ChoiceSpec, res: ChoiceResult) -> dict[str, Any]:
        prefix = self._echoes[spec.index // self._n]
        logprobs = None
        if self._logprobs:
            logprobs = legacy_logprobs(self._ctx.tokenizer, res.logprobs, len(prefix))
            if self._echo:
                logprobs = _merge_logprobs(
                    _echo_logprobs(self._ctx.tokenizer, spec.prompt_ids, res.prompt_logprobs), logprobs
                )
        return {
            "index": spec.index,
            "text": prefix + res.text,
            "logprobs": logprobs,
            "finish_reason": res.finish_reason,
        }

    def chunk(self, index: int, text: str, logprobs: dict[str, Any] | None, finish: str | None) -> dict[str, Any]:
        out = {**self._head, "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}]}
        if self._include_usage:
            out["usage"] = None
        return out

    def chunks(self, piece: Piece) -> list[dict[str, Any]]:
        spec = self._specs[piece.index]
        out = []
        if self._echo and piece.index not in self._echoed:
            self._echoed.add(piece.index)
            lps = (
                _echo_logprobs(self._ctx.tokenizer, spec.prompt_ids, piece.prompt_logprobs) if self._logprobs else None
            )
            out.append(self.chunk(piece.index, self._echoes[spec.index // self._n], lps, None))
        lps = None
        if self._logprobs:
            lps = legacy_logprobs(self._ctx.tokenizer, piece.logprobs, self._offsets[piece.index])
            self._offsets[piece.index] += sum(len(t) for t in lps["tokens"])
        if piece.text or piece.finish_reason or lps and lps["tokens"]:
            out.append(self.chunk(piece.index, piece.text, lps, piece.finish_reason))
        return out

    def usage_chunk(self, tally: Tally) -> dict[str, Any]:
        return {**self._head, "choices": [], "usage": tally.usage(self._ctx.config.enable_cache_report)}
