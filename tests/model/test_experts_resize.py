"""Elastic memory between the expert cache and the KV pools, in a real engine (engine/resize.py
`resize_memory`): a tiny gpt-oss checkpoint with MXFP4 experts, loaded through `load_model`
with `--moe-strategy offload`, serves eight greedy requests while the budget moves (expert cache
down and FULL pool up, then back) with `--debug-kv` auditing every step. The audit stays green,
the pools balance, the tokens equal a resident engine's without resizes, and a refused KV resize
leaves the expert cache's budget as it was.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from model_harness import VOCAB, make_reference
from safetensors.torch import save_file
from test_experts import to_mxfp4

from freetoken.config import EngineConfig
from freetoken.engine.build import build_engine_for, resolve_for_model
from freetoken.engine.engine import Engine
from freetoken.engine.resize import ResizeRefused
from freetoken.models.experts import expert_cache, experts_of
from freetoken.models.experts_cache import GIB
from freetoken.models.load import LoadedModel, load_model
from freetoken.request import Request, SamplingParams
from freetoken.tokenizer.testing import write_tiny_tokenizer

PROMPTS = [[5 + (i * 37 + j * 11) % 290 for j in range(9 + 3 * i)] for i in range(8)]


def write_mxfp4_gpt_oss(directory: Path) -> Path:
    """The harness's tiny gpt-oss with the tiny tokenizer, experts in MXFP4 (HF's layout)."""
    model = make_reference("gpt_oss", directory)
    sd = {k: v.float().contiguous() for k, v in model.state_dict().items()}
    for name in [k for k in sd if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        sd[name + "_blocks"], sd[name + "_scales"] = to_mxfp4(sd.pop(name).transpose(1, 2))
    save_file(sd, str(directory / "model.safetensors"))
    write_tiny_tokenizer(directory, vocab_size=VOCAB)
    return directory


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_mxfp4_gpt_oss(tmp_path_factory.mktemp("gpt_oss_mxfp4"))


def run(engine: Engine, resizes: dict[int, dict]) -> dict[str, list[int]]:
    """Serve PROMPTS; before step s, `engine.resize(**resizes[s])`. Tokens by request."""
    reqs = [Request(f"r{i}", p, SamplingParams(max_tokens=10, temperature=0.0)) for i, p in enumerate(PROMPTS)]
    for req in reqs:
        engine.add_request(req)
    step = 0
    while any(not r.finished for r in reqs):
        if step in resizes:
            engine.resize(**resizes[step])
        engine.step()
        step += 1
    return {r.rid: list(r.output_ids) for r in reqs}


def engine_over(loaded: LoadedModel, directory: Path) -> Engine:
    config = EngineConfig(
        model=str(directory), dtype="float32", page_size=4, debug_kv=True, num_tokens=1024, max_running_requests=4
    )
    return build_engine_for(config, loaded)


def test_budget_moves_between_expert_cache_and_kv_under_traffic(checkpoint: Path) -> None:
    resident = load_model(str(checkpoint), torch.float32, torch.device("cpu"), weights="auto")
    layer = experts_of(resident.model)[0]
    one_layer = sum(w.nbytes for w in (*layer.gate_up, *layer.down))
    offloaded = load_model(
        str(checkpoint),
        torch.float32,
        torch.device("cpu"),
        weights="auto",
        moe_strategy="offload",
        expert_cache_gb=2 * one_layer / GIB,
    )
    cache = expert_cache(offloaded.model)
    assert cache is not None and cache.capacity_bytes == int(2 * one_layer / GIB * GIB) and cache.bytes == 0

    expected = run(engine_over(resident, checkpoint), {})
    engine = engine_over(offloaded, checkpoint)
    moves = {
        3: {"full_tokens": 1536, "expert_cache_gb": one_layer / 2 / GIB},  # cache down, KV up
        7: {"full_tokens": 1024, "expert_cache_gb": 2 * one_layer / GIB},  # and back
    }
    assert run(engine, moves) == expected
    status = engine.status()
    assert status["integrity"]["violations"] == 0 and status["integrity"]["audits"] > 0
    full = status["pools"]["full"]
    assert full["capacity"] == full["free"] + full["cached"] + full["in_use"] + full["quarantined"]
    experts = status["experts"]
    assert experts["strategy"] == "offload" and experts["cache"]["capacity_bytes"] == int(2 * one_layer / GIB * GIB)
    assert cache.misses > 0 and cache.evictions > 0 and cache.hits > 0

    before = cache.capacity_bytes
    with pytest.raises(ResizeRefused) as refused:
        engine.resize(full_tokens=1, expert_cache_gb=0.0)  # below one page: refused, nothing changes
    assert refused.value.param == "full_tokens" and cache.capacity_bytes == before
    with pytest.raises(ResizeRefused, match="moe-strategy offload") as not_offloaded:
        engine_over(resident, checkpoint).resize(expert_cache_gb=1.0)
    assert not_offloaded.value.param == "expert_cache_gb" and not not_offloaded.value.conflict
    assert engine.resize(expert_cache_gb=0.0)["experts"] == {"capacity_bytes": 0, "bytes": 0, "freed_bytes": before}


def test_default_kv_pool_leaves_the_expert_cache_its_budget(checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--memory-ratio` sizes the FULL pool from free memory measured before the cache has filled:
    the cache's budget is taken off it first."""

    class Memory:
        available = 4 * GIB

    monkeypatch.setattr("freetoken.engine.build.psutil.virtual_memory", lambda: Memory)
    loaded = load_model(str(checkpoint), torch.float32, torch.device("cpu"), weights="auto")
    flags = {
        "model": str(checkpoint),
        "dtype": "float32",
        "page_size": 4,
        "memory_ratio": 0.5,
        "max_running_requests": 10**6,
    }
    pages = {
        gb: resolve_for_model(
            EngineConfig(**flags, moe_strategy="offload", expert_cache_gb=gb),
            loaded.config,
            torch.float32,
            torch.device("cpu"),
        ).full_pages
        for gb in (0.0, 2.0)
    }
    resident = resolve_for_model(
        EngineConfig(**flags, expert_cache_gb=2.0), loaded.config, torch.float32, torch.device("cpu")
    ).full_pages
    assert pages[0.0] == resident and pages[2.0] * 2 == pytest.approx(resident, abs=2)  # half the memory left
