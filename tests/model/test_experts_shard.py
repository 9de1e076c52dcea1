"""Tensor-parallel shards of packed experts (models/shard.py): the GGUF loader's deferred
per-expert lists and gpt-oss's MXFP4 blocks split like the float stacks, so the ranks' partial
expert outputs sum to the whole layer's (within the 8-bit activation rounding of the kernel:
each rank quantizes its own slice of the down projection's input), and an MXFP4 split that
would cut a 32-block is refused naming the flag. No processes: each rank's model is built here.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
import torch
import transformers
from model_harness import GPT_OSS
from test_experts import to_mxfp4, write_gpt_oss_gguf

from freetoken.errors import ConfigError
from freetoken.models.config import ModelConfig
from freetoken.models.experts import Experts, experts_of
from freetoken.models.registry import build_model, config_from_hf
from freetoken.models.shard import ShardPlan, shard_tensors
from freetoken.weights.gguf import load_gguf

WORLD = 2


@pytest.fixture(scope="module")
def reference() -> tuple[dict, dict]:
    """A tiny gpt-oss whose MLP width (64) splits into whole 32-blocks over two ranks."""
    torch.manual_seed(7)
    config = transformers.GptOssConfig(**{**GPT_OSS, "intermediate_size": 64})
    model = transformers.GptOssForCausalLM(config)
    sd = {k: (v + 0.05 * torch.randn_like(v)).float().contiguous() for k, v in model.state_dict().items()}
    return sd, config.to_dict()


def layer_experts(tensors: dict, config: ModelConfig) -> Experts:
    model = build_model(config, torch.float32, "cpu")
    model.load_weights(dict(tensors))
    return experts_of(model)[0]


def sharded_sum(
    tensors: dict, config: ModelConfig, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor
) -> torch.Tensor:
    out = torch.zeros_like(x)
    for rank in range(WORLD):
        plan = ShardPlan(rank, WORLD, config)
        part = layer_experts(shard_tensors(tensors, plan), plan.local_config())
        assert part.intermediate == config.intermediate_size // WORLD and part.runs_as() == "int8 (group 32)"
        out += part(x, ids, w)
    return out


def routed(config: ModelConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, config.hidden_size, generator=g)
    ids = torch.stack([torch.randperm(config.num_experts, generator=g)[:2] for _ in range(6)])  # [6, 2]
    return x, ids, torch.softmax(torch.randn(6, 2, generator=g), dim=-1)


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_gguf_expert_lists_shard_and_sum_to_the_layer(reference: tuple[dict, dict], tmp_path: Path) -> None:
    sd, hf = reference
    ck = load_gguf(
        write_gpt_oss_gguf(tmp_path / "q8.gguf", sd, hf, gguf.GGMLQuantizationType.Q8_0), keep_quantized=True
    )
    config = config_from_hf(ck.hf_config)
    x, ids, w = routed(config)
    whole = layer_experts(ck.tensors, config)(x, ids, w)
    assert relative(sharded_sum(ck.tensors, config, x, ids, w), whole) < 0.02


def test_mxfp4_blocks_shard_and_sum_to_the_layer(reference: tuple[dict, dict]) -> None:
    sd, hf = reference
    tensors = dict(sd)
    for name in [k for k in tensors if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        tensors[name + "_blocks"], tensors[name + "_scales"] = to_mxfp4(tensors.pop(name).transpose(1, 2))
    config = config_from_hf(hf)
    x, ids, w = routed(config)
    whole = layer_experts(tensors, config)(x, ids, w)
    assert relative(sharded_sum(tensors, config, x, ids, w), whole) < 0.02
    narrow = config_from_hf({**hf, "intermediate_size": 32})  # 16 columns a rank: half a block
    with pytest.raises(ConfigError, match="--tensor-parallel-size 2"):
        shard_tensors(tensors, ShardPlan(0, WORLD, narrow))
