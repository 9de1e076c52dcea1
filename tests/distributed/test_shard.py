"""Sharding a checkpoint's tensors (no processes): quantized matrices keep their integer form and
slice exactly like their dequantized values (rows; whole 32-groups of columns), vocab tables pad
to equal shards, row-parallel biases are kept by rank 0 only, KV heads replicate when the ranks
outnumber them, and world sizes that cannot split a model are refused with one line."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from freetoken.errors import ConfigError
from freetoken.models.registry import config_from_hf
from freetoken.models.shard import ShardPlan, check_shardable, shard_tensor
from freetoken.ops.quantized import (
    QuantizedWeight,
    dequantize,
    quantize_int4,
    quantize_int8,
)

HF = {"model_type": "llama", "vocab_size": 301, "hidden_size": 128, "intermediate_size": 128, "num_hidden_layers": 1,
      "num_attention_heads": 4, "num_key_value_heads": 2}


def plan(rank: int, world: int = 2, **overrides: int) -> ShardPlan:
    return ShardPlan(rank, world, config_from_hf({**HF, **overrides}))


@pytest.mark.parametrize("quantize", [quantize_int8, quantize_int4])
@pytest.mark.parametrize("name", ["model.layers.0.self_attn.o_proj.weight", "model.layers.0.mlp.gate_proj.weight"])
def test_quantized_shards_stay_quantized_and_exact(quantize, name: str) -> None:
    w = torch.randn(128, 128)
    qw = quantize(w)
    for rank in (0, 1):
        got = shard_tensor(name, qw, plan(rank))
        assert isinstance(got, QuantizedWeight) and got.bits == qw.bits
        want = shard_tensor(name, dequantize(qw, torch.float32), plan(rank))
        assert torch.equal(dequantize(got, torch.float32), want)
    cols = shard_tensor("model.layers.0.self_attn.o_proj.weight", w, plan(1))
    assert torch.equal(cols, w[:, 64:])  # row-parallel: the second half of the input columns


def test_columns_that_cut_a_group_are_dequantized() -> None:
    qw = quantize_int8(torch.randn(64, 96))
    p = plan(1, intermediate_size=96)  # down_proj columns 48:96 cut the second group
    got = shard_tensor("model.layers.0.mlp.down_proj.weight", qw, p)
    assert isinstance(got, torch.Tensor) and torch.equal(got, dequantize(qw, torch.float32)[:, 48:])


def test_vocab_rows_pad_to_equal_shards() -> None:
    w = torch.randn(301, 128)
    first, last = (shard_tensor("model.embed_tokens.weight", w, plan(r)) for r in (0, 1))
    assert first.shape == last.shape == (151, 128)
    assert torch.equal(torch.cat([first, last])[:301], w) and not last[150].any()
    q_last = shard_tensor("lm_head.weight", quantize_int8(w), plan(1))
    assert isinstance(q_last, QuantizedWeight) and q_last.shape == (151, 128)
    assert not dequantize(q_last, torch.float32)[150].any()


def test_row_parallel_bias_is_added_once() -> None:
    b = torch.randn(128)
    assert torch.equal(shard_tensor("model.layers.0.self_attn.o_proj.bias", b, plan(0)), b)
    assert not shard_tensor("model.layers.0.self_attn.o_proj.bias", b, plan(1)).any()
    q_bias = torch.randn(128)
    assert torch.equal(shard_tensor("model.layers.0.self_attn.q_proj.bias", q_bias, plan(1)), q_bias[64:])


def test_kv_heads_replicate_when_ranks_outnumber_them() -> None:
    k = torch.arange(32 * 128, dtype=torch.float32).view(32, 128)  # one KV head of 32 dims
    for rank in (0, 1):
        p = plan(rank, num_key_value_heads=1)
        assert p.kv_heads == 1 and p.local_config().num_kv_heads == 1
        assert torch.equal(shard_tensor("model.layers.0.self_attn.k_proj.weight", k, p), k)
    four = plan(3, world=4, num_attention_heads=8, num_key_value_heads=2)
    assert four.first_kv_head == 1  # query heads 6-7 read KV head 1


def test_experts_shard_gate_up_pairs_and_down_rows() -> None:
    p = plan(1, intermediate_size=8)
    gate_up = torch.arange(2 * 4 * 16, dtype=torch.float32).view(2, 4, 16)  # [E, h, 2i]
    assert torch.equal(shard_tensor("model.layers.0.mlp.experts.gate_up_proj", gate_up, p), gate_up[..., 8:])
    down = torch.randn(2, 8, 4)
    assert torch.equal(shard_tensor("model.layers.0.mlp.experts.down_proj", down, p), down[:, 4:])
    assert not shard_tensor("model.layers.0.mlp.experts.down_proj_bias", torch.randn(2, 4), p).any()


@pytest.mark.parametrize(("overrides", "world", "needle"), [
    ({}, 3, "does not divide the model's 4 attention heads"),
    ({"num_attention_heads": 6, "num_key_value_heads": 3}, 2, "3 KV heads"),
    ({"intermediate_size": 130}, 4, "MLP width 130"),
])
def test_unshardable_world_sizes_are_refused(overrides: dict[str, int], world: int, needle: str) -> None:
    config = config_from_hf({**HF, **overrides})
    with pytest.raises(ConfigError, match="--tensor-parallel-size") as err:
        check_shardable(config, world)
    assert needle in str(err.value) and "\n" not in str(err.value)
    check_shardable(dataclasses.replace(config), 1)
