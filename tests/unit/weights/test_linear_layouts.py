"""Qwen3.5's linear-attention tensors as llama.cpp's converter stores them (value heads tiled
across key groups) come back in HF's order (grouped by key head); a matrix whose columns move
stays in integer rows as stored, with its column order recorded."""

from __future__ import annotations

import torch

from freetoken.ops.qlinear import pack, qlinear
from freetoken.ops.quantized import ColumnOrderedWeight, dequantize, quantize_int8
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


def test_a_matrix_whose_columns_move_stays_quantized_as_stored() -> None:
    """ssm_out's columns are value heads in the tiled order: the matrix stays in its integers as
    the file stores it, and both the packed product and its dequantized form equal the HF-order
    matrix's (x's columns gathered into the stored order)."""
    k = 256 * HV  # a value head of 256 columns: one super-block each
    stored = torch.randn(8, k)
    moving = HFTensorAssembler("qwen35", 4, 2, torch.float32, (HK, HV, DK, k // HV))
    moving.add("blk.0.ssm_out.weight", stored.clone())
    hf = moving.tensors["model.layers.0.linear_attn.out_proj.weight"]  # the float path: columns moved
    q = quantize_int8(stored)
    moving.add_quantized("blk.1.ssm_out.weight", q)
    kept = moving.tensors["model.layers.1.linear_attn.out_proj.weight"]
    assert isinstance(kept, ColumnOrderedWeight) and kept.inner is q
    reference = dequantize(q)  # stored order
    assert torch.equal(dequantize(kept), _hf_order(reference, k // HV))
    packed = pack(kept)
    assert torch.equal(packed.dequantize(), dequantize(kept))
    x = torch.randn(3, k)
    y = qlinear(x, packed)
    assert torch.equal(y, qlinear(x[:, kept.order], pack(q)))  # the stored matrix, its inputs gathered
    exact = x @ dequantize(kept).T
    assert (y - exact).norm() < 0.02 * exact.norm()  # the kernel's own rounding of activations
    assert (qlinear(x, pack(q)) - exact).norm() > 0.5 * exact.norm()  # not gathered: another product
    torch.testing.assert_close(_hf_order(stored, k // HV), hf)
    still = HFTensorAssembler("qwen35", 4, 2, torch.float32, (HV, HV, DK, k // HV))  # as many key heads as value heads
    still.add_quantized("blk.0.ssm_out.weight", q)
    assert still.tensors["model.layers.0.linear_attn.out_proj.weight"] is q


def _hf_order(stored: torch.Tensor, dv: int) -> torch.Tensor:
    """Columns from the tiled order to the grouped one, head by head (the test's own statement)."""
    heads = stored.split(dv, dim=1)  # in tiled order: position p holds grouped head tiled(range)[p]
    by_head = dict(zip(tiled(list(range(HV))), heads))
    return torch.cat([by_head[h] for h in range(HV)], dim=1)
