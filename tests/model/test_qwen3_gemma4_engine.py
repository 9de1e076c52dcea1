"""The engine over tiny Qwen3, Qwen3-MoE and Gemma 4 checkpoints (`tests/tiny_models.py`): greedy
generation, batched with chunked prefill and page audits after every step (`--debug-kv`), gives
transformers' greedy tokens; a second round over the same prompts hits the prefix cache (for
Gemma 4 through its SWA pool, whose pages hold the sliding layers' narrower heads) and still
gives them.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import transformers

from freetoken.llm import LLM
from freetoken.request import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_models import write_tiny_model  # noqa: E402

NEW = 8


@pytest.fixture(scope="module", params=["qwen3", "qwen3_moe", "gemma4"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(request.param, Path(tmp_path_factory.mktemp(request.param)))


def hf_greedy(directory: Path, prompt: list[int]) -> list[int]:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch.float64, attn_implementation="eager"
    )
    model.config._experts_implementation = "eager"
    out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


def test_batched_greedy_equals_transformers_and_survives_a_cache_hit(checkpoint: Path) -> None:
    llm = LLM(
        str(checkpoint), dtype="float64", page_size=4, max_prefill_length=16, num_tokens=1024, debug_kv=True, threads=1
    )
    prompts = [list(range(3, 40)), list(range(3, 20)) + [7, 9, 11]]  # longer than the window (7), sharing a prefix
    want = [hf_greedy(checkpoint, p) for p in prompts]
    params = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
    first = llm.generate(prompts, params)
    assert [o.token_ids for o in first] == want
    again = llm.generate(prompts, params)
    assert [o.token_ids for o in again] == want
    assert all(o.cached_tokens > 0 for o in again)
