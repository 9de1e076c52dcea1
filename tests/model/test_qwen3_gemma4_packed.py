"""Qwen3-MoE and Gemma 4 experts from GGUF stay packed: the tiny models of
`test_qwen3_gemma4_parity.py` written with Q8_0 expert stacks (Qwen3-MoE: separate gate / up /
down; Gemma 4: llama.cpp's fused gate_up and down), loaded with `keep_quantized` (what
`--weights auto` does) their experts run as 8-bit groups and their logits stay close to the same
file loaded dequantized; with `--moe-strategy offload` and a cache of half a layer's experts,
greedy decoding equals resident decoding while the cache misses and evicts.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import gguf
import pytest
import torch

from freetoken.models.experts import experts_of, offload_experts
from freetoken.models.experts_cache import ExpertCache
from freetoken.models.registry import CausalLM, build_model, config_from_hf
from freetoken.weights.gguf import load_gguf
from model_harness import chunked_last_logits, paged_greedy
from test_qwen3_gemma4_parity import ARCH, gguf_metadata, gguf_tensors, make_reference

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit" / "weights"))
from gguf_writing import np32, write_gguf  # noqa: E402

IDS = [3, 17, 250, 9, 44, 101, 7, 63, 12, 200, 5]
# Relative logits error of Q8_0 experts run packed (int8 activations in the kernel) against the
# same experts dequantized; Gemma 4's tiny random weights amplify rounding (see the parity tests).
TOLERANCE = {"qwen3_moe": 0.01, "gemma4": 0.05}  # measured: 0.0007, 0.009


@pytest.fixture(scope="module", params=list(TOLERANCE))
def q8_file(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    family = request.param
    directory = Path(tmp_path_factory.mktemp(family))
    reference = make_reference(family, directory / "hf")
    sd = {k: v.detach().clone() for k, v in reference.state_dict().items()}
    tensors: dict[str, Any] = {}
    for name, t in gguf_tensors(family, reference.config, sd).items():
        if "_exps.weight" in name:  # [E, N, K] -> Q8_0 blocks, as llama-quantize writes them
            tensors[name] = (
                gguf.quants.quantize(np32(t), gguf.GGMLQuantizationType.Q8_0),
                gguf.GGMLQuantizationType.Q8_0,
            )
        else:
            tensors[name] = np32(t)
    path = write_gguf(directory / "q8.gguf", ARCH[family], gguf_metadata(family, reference.config), tensors)
    return family, path


def load(path: Path, keep_quantized: bool, cache: ExpertCache | None = None) -> CausalLM:
    ck = load_gguf(path, keep_quantized=keep_quantized)
    model = build_model(config_from_hf(ck.hf_config), torch.float32, "cpu")
    if cache is not None:
        offload_experts(model, cache)
    model.load_weights(ck.tensors)
    return model


def last_logits(model: CausalLM) -> torch.Tensor:
    return chunked_last_logits(model, IDS)


def greedy(model: CausalLM, n: int) -> list[int]:
    return paged_greedy(model, IDS[:6], n)


def test_gguf_experts_stay_packed(q8_file: tuple[str, Path]) -> None:
    family, path = q8_file
    packed, twin = load(path, keep_quantized=True), load(path, keep_quantized=False)
    assert {x.runs_as() for x in experts_of(packed)} == {"int8 (group 32)"}
    assert {x.runs_as() for x in experts_of(twin)} == {"float32"}
    got, want = last_logits(packed), last_logits(twin)
    err = float((got - want).norm() / want.norm())
    assert 0 < err < TOLERANCE[family], f"{family}: packed Q8_0 experts {err:.4f} from the dequantized ones"


def test_offload_smaller_than_the_experts_matches_resident(q8_file: tuple[str, Path]) -> None:
    _, path = q8_file
    resident = load(path, keep_quantized=True)
    one_layer = sum(w.nbytes for w in (*experts_of(resident)[0].gate_up, *experts_of(resident)[0].down))
    cache = ExpertCache(one_layer // 2)  # two of a layer's four experts
    offloaded = load(path, keep_quantized=True, cache=cache)
    assert cache.misses == 0 and cache.bytes == 0  # nothing decoded at load
    assert greedy(offloaded, 6) == greedy(resident, 6)
    assert cache.misses > 0 and cache.evictions > 0 and cache.bytes <= cache.capacity_bytes
