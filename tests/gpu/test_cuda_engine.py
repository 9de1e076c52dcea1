"""The engine on CUDA with what the device runs by default: the Triton decode attention, CUDA
graphs for decode steps (engine/cuda_graphs.py) and, under --weights int4, the Triton quantized
linear (ops/triton_qlinear.py). Greedy tokens with graphs equal those without (float32 tiny
models: the graph replays the eager kernels over static buffers), the graphs were replayed, the
KV audit held after every step (--debug-kv) and the pools balance at idle.

Run it where a device is lent: `python -m pytest -q -m gpu tests/gpu` (scripts/gpu_check.sh does).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tiny_models import write_tiny_model  # noqa: E402

from freetoken.config import EngineConfig  # noqa: E402
from freetoken.llm import LLM  # noqa: E402
from freetoken.models.linear import Linear  # noqa: E402
from freetoken.request import SamplingParams  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

PROMPTS = [[5, 9, 2, 7, 1, 3], [4, 4, 8], [6, 1, 2, 3, 9, 9, 7, 5, 4, 2, 1], list(range(10, 50))]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def run(directory: Path, graphs: bool, weights: str) -> tuple[list[list[int]], LLM]:
    config = EngineConfig(
        model=str(directory), device="cuda", dtype="float32", weights=weights, prefill_weights="quantized",
        page_size=4, num_tokens=4096, debug_kv=True, cuda_graphs=graphs,
    )
    llm = LLM(config=config)
    out = llm.generate(PROMPTS, GREEDY)
    return [o.token_ids for o in out], llm


@pytest.mark.parametrize("family", ["llama", "gemma3"])  # gemma3: sliding-window layers (SWA tables in the graphs)
@pytest.mark.parametrize("weights", ["auto", "int4"])
def test_graphs_replay_the_eager_tokens(tmp_path: Path, family: str, weights: str) -> None:
    directory = write_tiny_model(family, tmp_path / family)
    eager, plain = run(directory, False, weights)
    assert plain.engine.runner.graphs is None
    graphed, llm = run(directory, True, weights)
    graphs = llm.engine.runner.graphs
    assert graphs is not None and graphs.captures >= 1 and graphs.replays >= 5, "decode steps did not replay graphs"
    assert graphed == eager
    if weights == "int4":
        kinds = {type(m.packed).__name__ for m in llm.engine.runner.model.modules() if isinstance(m, Linear) and m.packed is not None}
        assert kinds == {"TritonPackedWeight"}
