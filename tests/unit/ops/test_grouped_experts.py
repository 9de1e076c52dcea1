"""Super-block experts (GGUF Q4_K / Q6_K kept in their own integers) and the grouped forward: every
active expert of a step in one kernel call per projection gives the per-expert loop's result bit
for bit (same row chunks, same order of the weighted sum), at decode and prefill row counts, with
biases and with an expert that takes more than one row chunk; and both are within the kernel's
bound of the float experts they quantize.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from freetoken.models.experts import Experts
from freetoken.ops.layers import gated_act
from freetoken.ops.qlinear import grouped_matmul_available
from freetoken.ops.superblock import PackedSuperBlock
from tests.unit.ops.test_superblock import _weight

pytestmark = pytest.mark.skipif(not grouped_matmul_available(),
                                reason="the super-block kernel is not built on this machine")

E, H, I = 6, 512, 768  # down's K = 768: whole chunk, then a half one


def _experts(dtype: torch.dtype, bias: bool, down_kind: str = "q6_k", local: range | None = None) -> Experts:
    ex = Experts(E, H, I, lambda g, u: gated_act(torch.cat([g, u], -1), "silu"), bias, dtype, "cpu")
    ex.local = local  # expert parallelism (models.shard.split_experts sets it before the load)
    gate = [_weight("q4_k", I, H, seed=3 * e) for e in range(E)]
    up = [_weight("q4_k", I, H, seed=3 * e + 1) for e in range(E)]
    down = [_weight(down_kind, H, I, seed=3 * e + 2) for e in range(E)]
    g = torch.Generator().manual_seed(9)
    biases = [torch.randn(E, n, generator=g) * 0.1 for n in (I, I, H)] if bias else [None] * 3
    ex.load(gate, up, down, *biases)
    return ex


def _routing(T: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])  # [T, k], distinct per token
    if T >= 12:
        ids[:12, 0] = 2  # expert 2 takes 12 rows: more than one chunk of 8
    weights = torch.rand(T, k, generator=g).softmax(-1)
    return ids, weights


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 3, 17])
@pytest.mark.parametrize("bias", [False, True])
def test_grouped_forward_is_the_per_expert_loop(dtype: torch.dtype, T: int, bias: bool) -> None:
    ex = _experts(dtype, bias)
    assert all(isinstance(m, PackedSuperBlock) for m in (*ex.gate_up, *ex.down))
    assert ex.runs_as() == "q4_k"
    ids, weights = _routing(T, 4, seed=T)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(1)).to(dtype)
    grouped = ex(x, ids, weights)
    assert ex._grouped is True
    ex._grouped = False  # the per-expert loop
    loop = ex(x, ids, weights)
    assert torch.equal(grouped, loop)


@pytest.mark.parametrize("grouped", [True, False])
@pytest.mark.parametrize("T", [1, 17])
def test_expert_parallel_halves_are_the_whole_layer(grouped: bool, T: int) -> None:
    """Two ranks holding experts 0-2 and 3-5 (models.shard's expert parallelism): rank 1's per-pair
    outputs added to rank 0's (what the all-reduce does) give the one-rank layer bit for bit, in
    the grouped kernel path and the per-expert loop; each rank decodes only its own experts."""
    whole = _experts(torch.bfloat16, bias=True)
    halves = [_experts(torch.bfloat16, bias=True, local=range(0, 3)), _experts(torch.bfloat16, bias=True, local=range(3, 6))]
    assert halves[1].gate_up[0] is None and halves[1].gate_up[3] is not None
    ids, weights = _routing(T, 4, seed=T + 7)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    for ex in (whole, *halves):
        ex._grouped = grouped
    theirs: list[torch.Tensor] = []
    halves[1].combine = lambda c: theirs.append(c.clone())
    halves[1](x, ids, weights)
    halves[0].combine = lambda c: c.add_(theirs[0])
    assert torch.equal(halves[0](x, ids, weights), whole(x, ids, weights))


def test_grouped_forward_is_within_the_kernel_bound_of_float_experts() -> None:
    ex = _experts(torch.float32, bias=False, down_kind="q4_k")
    ref = Experts(E, H, I, ex.act, False, torch.float32, "cpu")
    ref.gate_up = [m.dequantize(torch.float32) for m in ex.gate_up]
    ref.down = [m.dequantize(torch.float32) for m in ex.down]
    ids, weights = _routing(5, 3, seed=4)
    x = torch.randn(5, H, generator=torch.Generator().manual_seed(2))
    got, want = ex(x, ids, weights), ref(x, ids, weights)
    assert ex._grouped and not ref._grouped
    # activations are quantized per 32-group to int8 (twice: x, then h): ~1% of the output's scale
    assert float((got - want).abs().max()) <= 0.02 * float(want.abs().max())


def test_experts_of_two_super_block_kinds_fuse_as_group32() -> None:
    ex = Experts(2, H, I, lambda g, u: g * u, False, torch.float32, "cpu")
    gate = [_weight("q4_k", I, H, seed=e) for e in range(2)]
    up = [_weight("q6_k", I, H, seed=5 + e) for e in range(2)]
    down = [_weight("q4_k", H, I, seed=7 + e) for e in range(2)]
    ex.load(gate, up, down)
    assert ex.runs_as() == "int8 (group 32)"
    x = torch.randn(2, H)
    out = ex(x, torch.tensor([[0, 1], [1, 0]]), torch.full((2, 2), 0.5))
    assert not ex._grouped and out.shape == (2, H)


def test_gguf_super_block_stacks_load_as_super_blocks_resident_or_offloaded() -> None:
    """A GGUF [E, N, K] Q4_K / Q6_K expert stack decodes each expert in its own integers (exactly
    gguf's dequantization); resident experts (grouped) and offloaded ones decoded through a cache
    of two experts (the per-expert loop) give the same output bit for bit."""
    import gguf
    from gguf import quants

    from freetoken.models.experts_cache import ExpertCache
    from freetoken.ops.quantized import dequantize
    from freetoken.weights.gguf import expert_stack
    from tests.unit.ops.test_superblock import _blocks

    Q = gguf.GGMLQuantizationType
    stacks = {}
    for name, qtype, (n, k) in (("gate", Q.Q4_K, (I, H)), ("up", Q.Q4_K, (I, H)), ("down", Q.Q6_K, (H, I))):
        raw = np.concatenate([_blocks(qtype, n, k, seed=len(stacks) * E + e) for e in range(E)])
        stacks[name] = expert_stack(raw, qtype, (E, n, k), name)
        w = stacks[name][3].make()
        assert w.kind == ("q4_k" if qtype == Q.Q4_K else "q6_k")
        per = raw.shape[0] // E
        assert np.array_equal(dequantize(w).numpy(), quants.dequantize(raw[3 * per : 4 * per].reshape(n, -1), qtype))
    act = lambda g, u: gated_act(torch.cat([g, u], -1), "silu")  # noqa: E731
    resident = Experts(E, H, I, act, False, torch.bfloat16, "cpu")
    resident.load(stacks["gate"], stacks["up"], stacks["down"])
    offloaded = Experts(E, H, I, act, False, torch.bfloat16, "cpu")
    one = sum(m.nbytes for m in resident.matrices(0))
    offloaded.cache = ExpertCache(2 * one)
    offloaded.load(stacks["gate"], stacks["up"], stacks["down"])
    ids, weights = _routing(9, 3, seed=5)
    x = torch.randn(9, H, generator=torch.Generator().manual_seed(6)).bfloat16()
    assert torch.equal(resident(x, ids, weights), offloaded(x, ids, weights))
    assert resident._grouped and not offloaded._grouped and offloaded.cache.evictions > 0
