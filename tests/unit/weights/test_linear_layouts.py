"""Qwen3.5's linear-attention tensors as llama.cpp's converter stores them (value heads tiled
across key groups) come back in HF's order (grouped by key head), and a matrix whose columns move
is never kept in integer rows (its row blocks would be read in the wrong order)."""

from __future__ import annotations

import torch

from freetoken.weights.names import HFTensorAssembler

HK, HV, DK, DV = 2, 4, 3, 2  # key heads, value heads, key dim, value dim


def tiled(grouped: list[int]) -> list[int]:
    """The converter's order of value heads: head j of key group g at j * HK + g."""
    per = HV // HK
    return [grouped[g * per + j] for j in range(per) for g in range(HK)]


def test_value_heads_come_back_grouped() -> None:
    a = HFTensorAssembler("qwen35", 4, 2, torch.float32, (HK, HV, DK, DV))
    heads = list(range(HV))  # head h's rows hold h
    gate = torch.tensor([[float(h)] * 5 for h in tiled(heads) for _ in range(DV)])  # [HV * DV, 5]
    a.add("blk.0.attn_gate.weight", gate)
    out = a.tensors["model.layers.0.linear_attn.in_proj_z.weight"]
    assert out[:, 0].tolist() == [float(h) for h in heads for _ in range(DV)]
    cols = torch.tensor([[float(h) for h in tiled(heads) for _ in range(DV)]] * 3)  # [3, HV * DV]
    a.add("blk.0.ssm_out.weight", cols)
    assert a.tensors["model.layers.0.linear_attn.out_proj.weight"][0].tolist() == [
        float(h) for h in heads for _ in range(DV)
    ]
    a.add("blk.0.ssm_a", -torch.exp(torch.tensor([float(h) for h in tiled(heads)])))
    assert torch.allclose(a.tensors["model.layers.0.linear_attn.A_log"], torch.tensor([float(h) for h in heads]))


def test_a_matrix_whose_columns_move_is_decoded() -> None:
    moving = HFTensorAssembler("qwen35", 4, 2, torch.float32, (HK, HV, DK, DV))
    assert not moving.can_stay_quantized("blk.0.ssm_out.weight")
    assert moving.can_stay_quantized("blk.0.attn_qkv.weight")  # rows move: integer rows follow them
    still = HFTensorAssembler("qwen35", 4, 2, torch.float32, (HV, HV, DK, DV))  # as many key heads as value heads
    assert still.can_stay_quantized("blk.0.ssm_out.weight")
