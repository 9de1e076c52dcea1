"""GGUF blocks -> group-32 integers: against the exact dequantization, type by type.

Exact types (the integers and the float16 scales are the file's own) must dequantize bit for bit
to what `weights.dequant` (itself bit-identical to gguf's reference) gives; the K-quants round the
product d * sub-block scale to float16 once (relative error <= 2^-11 of the scale, so <= 2^-11 of
the group's range); Q6_K is requantized to absmax int8 (error <= half a step of the new grid).
Real tensors of both bundled files, random block bytes for every type, and the llama row
permutation of a quantized q/k projection. Then each type through the quantized linear layer
(`ops.qlinear`, our kernel here) against float64 products with the exact dequantized weights,
within a stated relative error.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from freetoken.errors import ModelLoadError
from freetoken.ops.quantized import GROUP, dequantize as dequantize_groups
from freetoken.weights.dequant import dequantize
from freetoken.weights.requant import INTEGER_TYPES, to_quantized
from block_data import block_bytes

Q = gguf.GGMLQuantizationType
EXACT = {Q.Q8_0, Q.Q5_0, Q.Q5_1, Q.Q4_0, Q.Q4_1}
BITS = {Q.Q8_0: 8, Q.Q5_0: 8, Q.Q5_1: 8, Q.Q5_K: 8, Q.Q6_K: 8, Q.Q4_0: 4, Q.Q4_1: 4, Q.Q4_K: 4}


def check(raw: np.ndarray, qtype: Q, shape: tuple[int, int], name: str) -> None:
    qw = to_quantized(raw, qtype, shape, name)
    assert qw.bits == BITS[qtype] and tuple(qw.q.shape) == shape
    if qw.bits == 4:
        assert int(qw.q.min()) >= 0 and int(qw.q.max()) <= 15
    want = dequantize(raw, qtype, shape, name)  # float32, bit-identical to gguf's reference
    got = dequantize_groups(qw, torch.float32)
    if qtype in EXACT:
        assert torch.equal(got, want), name
        return
    groups = want.view(-1, GROUP)
    err = (got.view(-1, GROUP) - groups).abs().amax(dim=1)
    spread = groups.amax(dim=1) - groups.amin(dim=1)
    if qtype == Q.Q6_K:
        bound = groups.abs().amax(dim=1) / 127 * 0.5 * (1 + 1e-3) + 1e-12
    else:  # one float16 rounding of scale and minimum: <= 2^-11 of each, over 15 or 31 steps
        bound = (spread + groups.abs().amax(dim=1)) * 2.0**-10 + 1e-12
    assert bool((err <= bound).all()), f"{name}: worst {float((err / bound).max()):.3f} of the bound"


@pytest.mark.parametrize("qtype", sorted(INTEGER_TYPES, key=int))
def test_random_block_bytes(qtype: Q) -> None:
    raw, shape = block_bytes(qtype, seed=200 + int(qtype))
    check(raw, qtype, shape, f"random {qtype.name}")


@pytest.mark.real_model
@pytest.mark.parametrize("which", ["gemma", "smollm2"])
def test_real_tensors(which: str, request: pytest.FixtureRequest) -> None:
    reader = request.getfixturevalue(f"{which}_reader")
    seen = set()
    for t in reader.tensors:
        if int(t.tensor_type) not in INTEGER_TYPES or len(t.shape) != 2 or int(t.n_elements) > 2_000_000:
            continue  # the embedding (167M values) is Q8_0 like smaller tensors: skip it for time
        qtype = Q(int(t.tensor_type))
        if qtype.name in seen and qtype not in (Q.Q6_K, Q.Q4_K):
            continue
        check(t.data, qtype, (int(t.shape[1]), int(t.shape[0])), t.name)
        seen.add(qtype.name)
    assert seen == ({"Q8_0", "Q5_0", "Q4_K", "Q6_K"} if which == "gemma" else {"Q4_1"})


def test_llama_q_rows_are_unpermuted_like_the_float_path() -> None:
    """A quantized attn_q gets the same row rearrangement as its dequantized twin."""
    from freetoken.weights.names import HFTensorAssembler

    rng = np.random.default_rng(5)
    values = rng.standard_normal((16, 64)).astype(np.float32)
    raw = gguf.quants.quantize(values, Q.Q8_0)
    floats, ints = HFTensorAssembler("llama", 2, 1), HFTensorAssembler("llama", 2, 1)
    floats.add("blk.0.attn_q.weight", dequantize(raw, Q.Q8_0, (16, 64)))
    ints.add_quantized("blk.0.attn_q.weight", to_quantized(raw, Q.Q8_0, (16, 64)))
    name = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(dequantize_groups(ints.finish()[name]), floats.finish()[name])


def test_errors_name_the_tensor() -> None:
    with pytest.raises(ModelLoadError, match=r"blk\.0\.x.*F16 has no integer form"):
        to_quantized(np.zeros(64, dtype=np.float16), Q.F16, (2, 32), "blk.0.x")
    with pytest.raises(ModelLoadError, match="expected 68"):
        to_quantized(np.zeros(34, dtype=np.uint8), Q.Q8_0, (2, 32), "short")
    with pytest.raises(ModelLoadError, match="not a matrix"):
        to_quantized(np.zeros(34, dtype=np.uint8), Q.Q8_0, (32,), "vector")


def linear_error(raw: np.ndarray, qtype: Q, shape: tuple[int, int], name: str) -> float:
    """Relative RMS error of `qlinear` on the matrix, against float64 x @ W^T of the exact
    dequantized values, over decode (1, 4 rows) and prefill (70 rows) shapes, bf16 activations."""
    from freetoken.ops import PackedWeight, qlinear

    packed = PackedWeight.from_quantized(to_quantized(raw, qtype, shape, name))
    want_w = dequantize(raw, qtype, shape, name).double()
    gen = torch.Generator().manual_seed(int(qtype))
    worst = 0.0
    for rows in (1, 4, 70):
        x = torch.randn(rows, shape[1], generator=gen).bfloat16()
        want = x.double() @ want_w.T
        got = qlinear(x, packed).double()
        worst = max(worst, float((got - want).norm() / want.norm()))
    return worst


# The kernel rounds activations to int8 per 32 values (and Q6_K / K-quant scales are rounded as
# above): measured 5-6e-3 relative RMS on these tensors; bf16 weights give ~2-3e-3.
LINEAR_TOLERANCE = 1.5e-2


@pytest.mark.parametrize("qtype", sorted(INTEGER_TYPES, key=int))
def test_quantized_linear_on_random_blocks(qtype: Q) -> None:
    raw, shape = block_bytes(qtype, seed=400 + int(qtype), n_blocks=128)
    assert linear_error(raw, qtype, shape, f"random {qtype.name}") < LINEAR_TOLERANCE


@pytest.mark.real_model
@pytest.mark.parametrize("which", ["gemma", "smollm2"])
def test_quantized_linear_on_real_tensors(which: str, request: pytest.FixtureRequest) -> None:
    """One layer tensor of every integer type in each bundled file, through the linear layer."""
    reader = request.getfixturevalue(f"{which}_reader")
    seen: dict[str, float] = {}
    for t in reader.tensors:
        name = Q(int(t.tensor_type)).name if int(t.tensor_type) in INTEGER_TYPES else None
        if name is None or name in seen or len(t.shape) != 2 or int(t.n_elements) > 2_000_000:
            continue
        seen[name] = linear_error(t.data, Q(int(t.tensor_type)), (int(t.shape[1]), int(t.shape[0])), t.name)
    assert set(seen) == ({"Q8_0", "Q5_0", "Q4_K", "Q6_K"} if which == "gemma" else {"Q4_1"})
    assert max(seen.values()) < LINEAR_TOLERANCE, seen
