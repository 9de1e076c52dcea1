"""The tensor-parallel plan of a quantized model (no processes): quantized weights close each block
by gathering (`ROW_GATHER`: o_proj / down_proj split by output rows, biases with them), float
weights by summing; the hidden size must split under gathering; each rank's weight plan and its
one-line summary; and rank 0's start-up check refuses a rank whose plan or K/V bytes differ, with
one line."""

from __future__ import annotations

import pytest
import torch

from freetoken.distributed.report import RankReport, check_reports
from freetoken.errors import ConfigError
from freetoken.models.formats import first_difference, summary, weight_formats
from freetoken.models.linear import Linear
from freetoken.models.registry import config_from_hf
from freetoken.models.shard import ROW_GATHER, ROW_SUM, ShardPlan, check_shardable, row_parallel_for, shard_tensor
from freetoken.ops.quantized import QuantizedWeight, dequantize, quantize_int4

HF = {"model_type": "llama", "vocab_size": 301, "hidden_size": 128, "intermediate_size": 128, "num_hidden_layers": 1,
      "num_attention_heads": 4, "num_key_value_heads": 2}


def test_quantized_weights_gather_float_weights_sum() -> None:
    q = {"model.layers.0.mlp.down_proj.weight": quantize_int4(torch.randn(8, 64))}
    f = {"model.layers.0.mlp.down_proj.weight": torch.randn(8, 64)}
    assert row_parallel_for(q, "auto") == ROW_GATHER
    assert row_parallel_for(f, "auto") == ROW_SUM
    assert row_parallel_for(f, "int8") == row_parallel_for(f, "int4") == ROW_GATHER
    assert row_parallel_for(q, "bf16") == ROW_SUM  # the policy dequantizes every matrix
    assert row_parallel_for({"model.layers.0.mlp.experts.down_proj": [q["model.layers.0.mlp.down_proj.weight"]]},
                            "auto") == ROW_GATHER


@pytest.mark.parametrize("name", ["model.layers.0.self_attn.o_proj", "model.layers.0.mlp.down_proj"])
def test_gathered_projections_split_output_rows(name: str) -> None:
    config = config_from_hf(HF)
    w, b = quantize_int4(torch.randn(128, 128)), torch.randn(128)
    for rank in (0, 1):
        plan = ShardPlan(rank, 2, config, ROW_GATHER)
        got = shard_tensor(f"{name}.weight", w, plan)
        assert isinstance(got, QuantizedWeight) and got.shape == (64, 128)  # whole input, half the rows
        assert torch.equal(dequantize(got), dequantize(w)[64 * rank:64 * (rank + 1)])
        assert torch.equal(shard_tensor(f"{name}.bias", b, plan), b[64 * rank:64 * (rank + 1)])  # each row's own


def test_gathering_needs_the_hidden_size_to_split() -> None:
    config = config_from_hf({**HF, "hidden_size": 98, "num_attention_heads": 8, "num_key_value_heads": 4,
                                  "head_dim": 16})
    check_shardable(config, 4, ROW_SUM)
    with pytest.raises(ConfigError, match="--tensor-parallel-size 4 does not divide the model's hidden size 98"):
        check_shardable(config, 4, ROW_GATHER)


def test_weight_formats_name_what_each_matrix_runs_as() -> None:
    model = torch.nn.Module()
    model.a, model.b, model.c = (Linear(64, 32, False, torch.float32, "cpu") for _ in range(3))
    model.a.load_quantized(quantize_int4(torch.randn(32, 64)))
    plan = weight_formats(model)
    assert plan == {"a": "int4", "b": "float32", "c": "float32"}
    assert summary(plan) == "3 matrices: float32 x2, int4 x1"
    assert first_difference(plan, {**plan, "c": "int8"}) == "c: float32 vs int8"
    assert first_difference(plan, dict(plan)) is None


def report(rank: int, formats: dict[str, str] | None = None, kv_bytes: int = 1000, kv_dtype: str = "int8") -> RankReport:
    return RankReport(rank, formats or {"layers.0.mlp.gate_up_proj": "int5", "layers.0.mlp.down_proj": "int4"}, kv_bytes, kv_dtype)


@pytest.mark.parametrize(("other", "needle"), [
    (report(1, {"layers.0.mlp.gate_up_proj": "int8", "layers.0.mlp.down_proj": "int4"}),
     "rank 1 runs its weights differently from rank 0 (layers.0.mlp.gate_up_proj: int5 vs int8"),
    (report(1, kv_bytes=4000, kv_dtype="float32"), "rank 1 holds 4000 bytes of float32 K/V where rank 0 holds 1000 bytes of int8"),
])
def test_a_rank_that_built_something_else_is_refused(other: RankReport, needle: str) -> None:
    check_reports([report(0), report(1)])
    with pytest.raises(ConfigError) as err:
        check_reports([report(0), other])
    assert needle in str(err.value) and "\n" not in str(err.value)
