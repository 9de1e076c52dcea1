"""What a cache-aware router asks of a worker (sglang-router, vllm-router; docs/scale-out.md).

Owns the answers to the probes those routers send, beside `/health` and `/metrics`:
`/server_info` and `/model_info` (sglang-router reads them at registration: the served model
name becomes the worker's model id, `model_path` is where it looks for a tokenizer) with the
older names `/get_server_info` and `/get_model_info`; `/get_load` (SGLang's shape, read by
sglang-router's `power_of_two` policy); `/health_generate` (a one-token greedy generation: 200
when the engine really produces a token); and the `x-freetoken-replica` header's value,
`host:port` of this server, so a client behind a router can tell which replica answered. The
routes themselves are admin/probes.py's; like `/health` and `/metrics` they need no API key. It
reaches the engine only through the serving context's client and never imports torch.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from freetoken import __version__
from freetoken.errors import FreeTokenError
from freetoken.request import SamplingParams
from freetoken.server.context import ServingContext
from freetoken.weights.source import resolve_model

REPLICA_HEADER = "x-freetoken-replica"
SERVER_INFO_PATHS = ("/server_info", "/get_server_info")
MODEL_INFO_PATHS = ("/model_info", "/get_model_info")
PROBE_PATHS = (*SERVER_INFO_PATHS, *MODEL_INFO_PATHS, "/get_load", "/health_generate")
HEALTH_GENERATE_TIMEOUT_S = 30.0  # a hang guard: one token on an idle engine takes milliseconds
HEALTH_PROMPT = "ping"


@dataclass(frozen=True)
class ModelFacts:
    """Where the model is and what it is, as SGLang's `/model_info` names them."""

    model_path: str
    tokenizer_path: str | None  # a directory with tokenizer.json; None for a GGUF file
    model_type: str | None
    architectures: list[str]


def replica_name(ctx: ServingContext) -> str:
    """This server as `host:port`, the `x-freetoken-replica` header's value."""
    return f"{socket.gethostname()}:{ctx.config.port}"


def model_facts(spec: str | None, architecture: str) -> ModelFacts:
    """From `--model` (resolved as serve.py resolved it: a short name is its bundled GGUF file)
    and the engine's architecture. A directory's config.json gives the Hugging Face names; a
    GGUF file has only its `general.architecture`, and sglang-router cannot read a GGUF
    tokenizer, so it gets none."""
    source = resolve_model(spec)
    path = source.path.resolve()
    if source.kind == "safetensors":
        hf = json.loads((path / "config.json").read_text())
        return ModelFacts(str(path), str(path), hf.get("model_type"), list(hf.get("architectures") or [architecture]))
    return ModelFacts(str(path), None, architecture, [architecture])


def server_info(ctx: ServingContext, facts: ModelFacts) -> dict[str, Any]:
    """SGLang's `/server_info` fields that routers read, plus FreeToken's own limits."""
    info = ctx.ready_info()
    engine = ctx.client.config
    return {
        "served_model_name": ctx.served_name,
        "model_path": facts.model_path,
        "tokenizer_path": facts.tokenizer_path,
        "version": __version__,
        "engine": "freetoken",
        "dp_size": 1,
        "tp_size": engine.tensor_parallel_size,
        "context_length": info.context_length,
        "page_size": info.page_size,
        "cache_type": info.cache_type,
        "max_running_requests": ctx.config.max_running_requests,
        "max_waiting_requests": ctx.config.max_waiting_requests,
        "max_prefill_tokens": engine.max_prefill_length,
    }


def model_info(ctx: ServingContext, facts: ModelFacts) -> dict[str, Any]:
    info = ctx.ready_info()
    return {
        "model_path": facts.model_path,
        "tokenizer_path": facts.tokenizer_path,
        "served_model_name": ctx.served_name,
        "is_generation": True,
        "model_type": facts.model_type,
        "architectures": facts.architectures,
        "context_length": info.context_length,
    }


async def load(ctx: ServingContext, status: Callable[[], Awaitable[dict[str, Any]]]) -> list[dict[str, Any]]:
    """SGLang's `/get_load`: one entry per data-parallel rank (here one); `num_tokens` is the KV
    held by requests (full-attention pages in use x page size)."""
    doc = await status()
    engine = doc.get("engine") or {}
    in_use = int(doc["pools"]["full"]["in_use"])
    return [
        {
            "dp_rank": 0,
            "num_reqs": int(engine.get("running", 0)),
            "num_waiting_reqs": int(engine.get("waiting", 0)),
            "num_tokens": in_use * int(doc["page_size"]),
        }
    ]


async def generate_one_token(ctx: ServingContext) -> None:
    """Run one greedy token through the engine; raises FreeTokenError or TimeoutError if it cannot."""
    ids = ctx.tokenizer.encode(HEALTH_PROMPT)
    stream = ctx.client.generate(
        f"health-{uuid.uuid4().hex}", ids, SamplingParams(max_tokens=1, temperature=0.0), eos_ids=()
    )
    async with contextlib.aclosing(stream), asyncio.timeout(HEALTH_GENERATE_TIMEOUT_S):  # closing aborts it
        async for update in stream:
            if update.finished:
                if update.error is not None or update.finish_reason == "error":
                    raise FreeTokenError(update.error or "the engine could not finish the health request")
                return
