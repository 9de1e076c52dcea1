"""Greedy outputs that repeat exactly on the real bundled Gemma 3 270M (Q4_K_M GGUF, bfloat16):
under `--deterministic` the same code prompts give the same tokens alone, batched with chunked
prefill, on a prefix-cache hit and with speculation; by default, speculation alone changes no
greedy output. A model the flag cannot keep its promise for is refused by name.

Outputs are compared between runs, never against stored text: the code prompts (this project's
own sources) may change and the equalities must still hold."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from freetoken.config import EngineConfig
from freetoken.errors import ConfigError
from freetoken.llm import LLM
from freetoken.models.load import LoadedModel, load_model
from freetoken.request import SamplingParams

GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
SOURCES = ["freetoken/engine/scheduler.py", "freetoken/attention/sdpa_backend.py"]


def code_prompts() -> list[str]:
    root = Path(__file__).resolve().parents[2]
    return [(root / s).read_text()[:2000] for s in SOURCES]


@pytest.fixture(scope="module")
def gemma_bf16() -> LoadedModel:
    return load_model("gemma3-270m", torch.bfloat16, torch.device("cpu"), weights="auto")


def run(loaded: LoadedModel, prompts: list[str], together: bool = False, **flags: object) -> list[list[int]]:
    llm = LLM(config=EngineConfig(model=str(loaded.source.path), num_tokens=16384, **flags), loaded=loaded)  # type: ignore[arg-type]
    if together:
        return [o.token_ids for o in llm.generate(prompts, GREEDY)]
    return [llm.generate([p], GREEDY)[0].token_ids for p in prompts]


def test_deterministic_outputs_are_the_same_alone_batched_cached_and_speculative(gemma_bf16: LoadedModel) -> None:
    prompts = code_prompts()
    alone = run(gemma_bf16, prompts, cache_type="naive", max_running_requests=1, deterministic=True)
    # Both at once, prefilled in chunks of 128 beside each other's decode rows.
    batched = run(gemma_bf16, prompts, together=True, max_prefill_length=128, cache_type="naive", deterministic=True)
    assert batched == alone
    llm = LLM(config=EngineConfig(model=str(gemma_bf16.source.path), num_tokens=16384, deterministic=True), loaded=gemma_bf16)
    first = [llm.generate([p], GREEDY)[0] for p in prompts]
    again = [llm.generate([p], GREEDY)[0] for p in prompts]  # the prompt from the cache, a short tail recomputed
    assert all(o.cached_tokens > 300 for o in again)
    assert [o.token_ids for o in first] == [o.token_ids for o in again] == alone
    spec = run(gemma_bf16, prompts, cache_type="naive", deterministic=True, speculative="ngram", spec_ngram_min=1)
    assert spec == alone


def test_speculation_changes_no_greedy_output_by_default(gemma_bf16: LoadedModel) -> None:
    prompts = code_prompts()
    plain = run(gemma_bf16, prompts, cache_type="naive", max_running_requests=1)
    llm = LLM(config=EngineConfig(model=str(gemma_bf16.source.path), num_tokens=16384, cache_type="naive",
                                  max_running_requests=1, speculative="ngram", spec_ngram_min=1), loaded=gemma_bf16)
    spec = [llm.generate([p], GREEDY)[0].token_ids for p in prompts]
    assert llm.engine.accepted_tokens > 0  # the drafts were verified, and some kept
    assert spec == plain


def test_a_model_it_cannot_serve_exactly_is_refused_by_name(tiny_gemma: LoadedModel, make_llm) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError, match="--deterministic.*float64"):  # the fixture computes in float64
        make_llm(tiny_gemma, deterministic=True, page_size=16)
