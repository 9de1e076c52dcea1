"""Qwen3.5, Qwen3.5-MoE and Qwen3-Next (Gated DeltaNet + gated attention) through the engine against
transformers on tiny random weights (`tests/tiny_models.py`): greedy tokens with prefill chunked
at several sizes and batched with requests of other lengths, page and state-slot audits after
every step (`--debug-kv`); the state pool balances (its free slots and the tree's snapshots).
Prefix hits through state snapshots: test_qwen3_5_prefix_cache.py."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import transformers

from freetoken.llm import LLM
from freetoken.request import Request, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_models import write_tiny_model  # noqa: E402

NEW = 6
PROMPTS = [list(range(3, 40)), list(range(3, 20)) + [7, 9, 11], [5, 6, 7], list(range(50, 120, 3))]


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_5_moe", "qwen3_next"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(request.param, Path(tmp_path_factory.mktemp(request.param)))


@pytest.fixture(scope="module")
def want(checkpoint: Path) -> list[list[int]]:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        checkpoint, dtype=torch.float64, attn_implementation="eager"
    )
    model.config._experts_implementation = "eager"
    out = []
    for p in PROMPTS:
        gen = model.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
        out.append(gen[0, len(p) :].tolist())
    return out


PARAMS = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("chunk", [5, 16, 64])
def test_batched_chunked_greedy_equals_transformers(checkpoint: Path, want: list[list[int]], chunk: int) -> None:
    """Four prompts of 3 to 37 tokens at once, prefill chunks of `chunk` tokens (5: chunks end
    mid-page and a prompt spans 8 of them, batched with others' decode rows)."""
    llm = LLM(str(checkpoint), dtype="float64", page_size=4, max_prefill_length=chunk, num_tokens=1024,
              debug_kv=True, threads=1)  # fmt: skip
    got = llm.generate(PROMPTS, PARAMS)
    assert [o.token_ids for o in got] == want
    kv = llm.engine.kv
    assert kv.state_pool is not None and kv.state_pool.num_free + kv.tree.num_pages("state") == kv.state_pool.capacity
    assert kv.audit(idle=True).ok


def run(llm: LLM, rid: str, prompt: list[int]) -> Request:
    req = Request(rid, prompt, PARAMS)
    llm.engine.add_request(req)
    while llm.engine.has_work():
        llm.engine.step()
    return req


def test_preempted_requests_recompute_from_a_fresh_state(checkpoint: Path, want: list[list[int]]) -> None:
    """A pool of 16 pages for four requests needing 2 to 11 pages each (two share a prefix, so
    24 pages no longer preempt): requests are preempted (their slot released, taken again at
    resume, from a snapshot where the tree keeps one) and still give transformers' tokens."""
    llm = LLM(str(checkpoint), dtype="float64", page_size=4, max_prefill_length=8, num_tokens=16 * 4,
              debug_kv=True, threads=1)  # fmt: skip
    got = llm.generate(PROMPTS, PARAMS)
    assert [o.token_ids for o in got] == want
    assert llm.engine.scheduler.preemptions > 0
    kv = llm.engine.kv
    assert kv.state_pool.num_free + kv.tree.num_pages("state") == kv.state_pool.capacity
    assert kv.audit(idle=True).ok


@pytest.mark.parametrize(
    ("overrides", "flag"),
    [
        ({"speculative": "ngram"}, "--speculative ngram"),
        ({"deterministic": True, "page_size": 16, "prefill_weights": "bf16"}, "--deterministic"),
        ({"device": "cuda"}, "--device cuda"),
    ],
    ids=["speculative", "deterministic", "cuda"],
)
def test_unsupported_flags_are_refused_in_one_line(checkpoint: Path, overrides: dict, flag: str) -> None:
    """What would corrupt or is untested on the recurrent state is refused by name (tensor
    parallelism: `models/shard.py` refuses the family before any rank loads)."""
    from freetoken.config import EngineConfig
    from freetoken.engine.build import refuse_unsupported_hybrid
    from freetoken.errors import ConfigError
    from freetoken.models.registry import config_from_hf

    config = EngineConfig(model=str(checkpoint), **overrides)
    model_config = config_from_hf(json.loads((checkpoint / "config.json").read_text()))
    device = torch.device(overrides.get("device", "cpu"))
    with pytest.raises(ConfigError, match=flag) as err:
        refuse_unsupported_hybrid(config, model_config, device)
    assert "\n" not in str(err.value)
    refuse_unsupported_hybrid(EngineConfig(model=str(checkpoint)), model_config, torch.device("cpu"))


def test_tensor_parallelism_is_refused(checkpoint: Path) -> None:
    from freetoken.errors import ConfigError
    from freetoken.models.registry import config_from_hf
    from freetoken.models.shard import check_shardable

    model_config = config_from_hf(json.loads((checkpoint / "config.json").read_text()))
    with pytest.raises(ConfigError, match="--tensor-parallel-size 2 is not supported"):
        check_shardable(model_config, 2)
