"""`POST /v1/completions`: raw prompts (a string, strings, token ids, lists of token ids).

Owns turning a CompletionRequest into engine choices (tokenization, the vocabulary and context
checks, `n` and per-choice seeds, echo) and the OpenAI `text_completion` bodies and stream chunks,
legacy logprobs included. Generation itself is `generation.run_choice`.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import replace
from typing import Any

import anyio.to_thread
from fastapi.responses import JSONResponse, Response

from freetoken.server.context import ServingContext
from freetoken.server.core.generation import ChoiceSpec, Clock, Piece, collect, first_piece, merge, run_choice
from freetoken.server.core.limits import check_context, check_max_tokens
from freetoken.server.core.logprobs import wire_logprob
from freetoken.server.core.streaming import Tally, record, sse_response, sse_stream
from freetoken.server.errors import bad_request
from freetoken.server.openai.protocol import CompletionRequest
from freetoken.server.request_hygiene import engine_rid
from freetoken.tokenizer import Tokenizer

ENDPOINT = "completions"
MAX_PROMPTS = 64


def prompt_ids(tokenizer: Tokenizer, prompt: str | list[str] | list[int] | list[list[int]], vocab_size: int) -> list[list[int]]:
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
                f"token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})", param="prompt", code="invalid_token_id"
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
        out["top_logprobs"].append(None if entry is None else {tokenizer.decode([t]): wire_logprob(lp) for t, lp in entry[2]})
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def _merge_logprobs(head: dict[str, Any], tail: dict[str, Any]) -> dict[str, Any]:
    return {key: head[key] + tail[key] for key in head}


async def create_completion(ctx: ServingContext, req: CompletionRequest, request_id: str) -> Response:
    clock = Clock()
    req.check_common()
    ctx.check_model(req.model)
    check_max_tokens(req.max_tokens)
    max_tokens = 16 if req.max_tokens is None else req.max_tokens
    if req.logprobs is not None and not 0 <= req.logprobs <= 20:
        raise bad_request(f"logprobs must be in [0, 20], got {req.logprobs}", param="logprobs")
    echo = bool(req.echo)
    prompt_logprobs = req.logprobs if echo and req.logprobs is not None else None
    req.sampling_params(max_tokens, logprobs=req.logprobs, prompt_logprobs=prompt_logprobs)  # range checks first
    info = ctx.ready_info()
    base = req.sampling_params(max_tokens, logprobs=req.logprobs, prompt_logprobs=prompt_logprobs, vocab_size=info.vocab_size)
    prompts = await anyio.to_thread.run_sync(prompt_ids, ctx.tokenizer, req.prompt, info.vocab_size)  # off the event loop
    for ids in prompts:
        check_context(len(ids), max_tokens, info.context_length, prompt_param="prompt", max_param="max_tokens")
    n = req.num_choices
    ctx.check_capacity(len(prompts) * n)
    response_id = f"cmpl-{uuid.uuid4().hex}"
    eos = frozenset(ctx.tokenizer.stop_ids)
    specs: list[ChoiceSpec] = []
    for p, ids in enumerate(prompts):
        for j in range(n):
            params = base if base.seed is None or j == 0 else replace(base, seed=base.seed + j)
            rid = engine_rid(request_id, response_id, p * n + j)
            specs.append(ChoiceSpec(p * n + j, rid, ids, params, eos, include_stop=bool(req.no_stop_trim)))
    tally = Tally([len(ids) for ids in prompts], [s.index // n for s in specs])
    pieces = merge([run_choice(ctx.client, spec, ctx.tokenizer) for spec in specs])
    created = int(time.time())
    head = {"id": response_id, "object": "text_completion", "created": created, "model": ctx.served_name}
    echo_texts = [ctx.tokenizer.decode(ids) if echo else "" for ids in prompts]
    if isinstance(req.prompt, str) and echo:
        echo_texts = [req.prompt]
    elif echo and req.prompt and isinstance(req.prompt[0], str):
        echo_texts = list(req.prompt)  # type: ignore[arg-type]

    if not req.stream:
        results = await collect(ctx.client, pieces, len(specs), clock)
        tally.add_results(results)
        choices = []
        for spec, res in zip(specs, results):
            prefix = echo_texts[spec.index // n]
            logprobs = None
            if req.logprobs is not None:
                logprobs = legacy_logprobs(ctx.tokenizer, res.logprobs, len(prefix))
                if echo:
                    logprobs = _merge_logprobs(_echo_logprobs(ctx.tokenizer, spec.prompt_ids, res.prompt_logprobs), logprobs)
            choices.append({"index": spec.index, "text": prefix + res.text, "logprobs": logprobs, "finish_reason": res.finish_reason})
        record(ctx, ENDPOINT, 200, tally, clock)
        return JSONResponse({**head, "choices": choices, "usage": tally.usage(ctx.config.enable_cache_report)})

    first = await first_piece(ctx.client, pieces)
    include_usage = req.include_usage
    offsets = [len(echo_texts[s.index // n]) for s in specs]
    echoed: set[int] = set()

    def chunk(index: int, text: str, logprobs: dict[str, Any] | None, finish: str | None) -> dict[str, Any]:
        out = {**head, "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}]}
        if include_usage:
            out["usage"] = None
        return out

    def chunks(piece: Piece) -> list[dict[str, Any]]:
        spec = specs[piece.index]
        out = []
        if echo and piece.index not in echoed:
            echoed.add(piece.index)
            lps = None
            if req.logprobs is not None:
                lps = _echo_logprobs(ctx.tokenizer, spec.prompt_ids, piece.prompt_logprobs)
            out.append(chunk(piece.index, echo_texts[spec.index // n], lps, None))
        lps = None
        if req.logprobs is not None:
            lps = legacy_logprobs(ctx.tokenizer, piece.logprobs, offsets[piece.index])
            offsets[piece.index] += sum(len(t) for t in lps["tokens"])
        if piece.text or piece.finish_reason or lps and lps["tokens"]:
            out.append(chunk(piece.index, piece.text, lps, piece.finish_reason))
        return out

    def usage_chunk(t: Tally) -> dict[str, Any]:
        return {**head, "choices": [], "usage": t.usage(ctx.config.enable_cache_report)}

    events = sse_stream(
        ctx, ENDPOINT, pieces, first, tally=tally, clock=clock, preamble=[], chunks=chunks,
        usage_chunk=usage_chunk if include_usage else None,
    )
    return sse_response(events)

