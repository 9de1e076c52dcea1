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
from freetoken.ops.quantized import GROUP, QuantizedWeight, RawGroupBlocks, concat, dequantize as dequantize_groups
from freetoken.weights.dequant import dequantize
from freetoken.weights.requant import INTEGER_TYPES, SUPERBLOCK_TYPES, group_rows, to_quantized
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


@pytest.mark.parametrize("qtype", sorted(INTEGER_TYPES - SUPERBLOCK_TYPES, key=int))
def test_a_group_matrix_stays_in_its_blocks_until_its_integers_are_read(qtype: Q) -> None:
    """`group_rows` keeps the file's blocks: rows permuted, padded and fused in that form, decoded
    once on first touch (packing) to exactly `to_quantized`'s integers, so a load holds one such
    matrix decoded at a time."""
    raw, shape = block_bytes(qtype, seed=600 + int(qtype))
    other, _ = block_bytes(qtype, seed=700 + int(qtype))
    w, v = group_rows(raw, qtype, shape), group_rows(other, qtype, shape)
    ints, v_ints = to_quantized(raw, qtype, shape), to_quantized(other, qtype, shape)
    order = torch.tensor([2, 0, 3, 1])
    permuted = w.map_rows(lambda t: t[order])
    padded = v.map_rows(lambda t: torch.cat([t, t.new_zeros(2, *t.shape[1:])]))
    fused = concat([permuted, v])
    assert isinstance(permuted, RawGroupBlocks) and isinstance(fused, RawGroupBlocks) and len(fused.parts) == 2
    assert fused.shape == (8, shape[1]) and fused.bits == ints.bits
    assert w._ints is None and v._ints is None and fused._ints is None  # nothing decoded yet
    reference = lambda qw: dequantize_groups(QuantizedWeight(qw.bits, qw.q, qw.scale, qw.minimum))  # noqa: E731
    assert torch.equal(reference(fused), torch.cat([reference(ints)[order], reference(v_ints)]))
    assert torch.equal(w.q, ints.q) and torch.equal(w.scale, ints.scale) and w._ints is not None
    assert (w.minimum is None) == (ints.minimum is None)
    if ints.minimum is None:  # zero block bytes are a zero matrix for the symmetric types
        assert torch.equal(reference(padded), torch.cat([reference(v_ints), torch.zeros(2, shape[1])]))
    assert not isinstance(w.map_rows(lambda t: t[1:3]), RawGroupBlocks)  # decoded: rows from the integers
    with pytest.raises(ModelLoadError, match="kept in its blocks"):
        group_rows(raw, Q.Q4_K, shape)


@pytest.mark.parametrize("how", ["in_passes", "from_blocks"])
@pytest.mark.parametrize(
    "case", ["q8_0", "q8_0 within 5 bits, then not", "q8_0 within 5 bits", "q5_0", "q4_0 fused", "q8_0 fused"]
)
def test_packing_from_the_blocks_is_the_packing_of_the_whole_matrix(
    how: str, case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`PackedWeight.in_passes` (a matrix still in its blocks, packed a few rows at a time) and
    `from_blocks` (Q8_0 moved natively by csrc/repack.cpp, the rest in passes) give the bytes,
    scales, minima and width of packing the decoded matrix at once, including the restart at 8 bits
    when a pass after the first does not fit 5, and 5 bits for a Q8_0 matrix whose integers fit."""
    import importlib

    layout = importlib.import_module("freetoken.ops.layout")
    qlinear = importlib.import_module("freetoken.ops.qlinear")  # the module (the package exports a function of its name)
    monkeypatch.setattr(qlinear, "ROWS_PER_PASS", 3)
    monkeypatch.setattr(layout, "ROWS_PER_PASS", 2)  # PackedWeight's pack_rows, in passes too
    qtype = {"q5_0": Q.Q5_0, "q4_0 fused": Q.Q4_0}.get(case, Q.Q8_0)
    five = qlinear._FIVE_BITS
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(int(qtype))
    rows, k = 11, 640  # 11 rows: passes of 3 and a short last one; K = 640: a compact tail
    values = rng.standard_normal((rows, k)).astype(np.float32)
    raw = gguf.quants.quantize(values, qtype).reshape(rows, -1)
    if case.startswith("q8_0 within 5 bits"):
        blocks = raw.reshape(-1, type_size).copy()
        ints = blocks[:, 2:].view(np.int8)
        ints[:] = np.clip(ints, -16, 15)
        if case.endswith("then not"):
            ints[7 * (k // block_size), 3] = 100  # row 7 (the third pass) leaves the 5-bit range
        raw = blocks.reshape(rows, -1)
    w = group_rows(raw, qtype, (rows, k))
    if case.endswith("fused"):
        w = concat([w.rows(0, 4), w.rows(4, rows)])
        assert isinstance(w, RawGroupBlocks) and len(w.parts) == 2
    got = getattr(qlinear.PackedWeight, how)(w)
    ints = to_quantized(raw, qtype, (rows, k))
    want = qlinear.PackedWeight(ints)
    assert torch.equal(want.packed, layout._pack(ints.q, want.bits))  # pack_rows' passes: the one packing
    expected_bits = {"q5_0": 5 if five else 8, "q4_0 fused": 4, "q8_0 within 5 bits": 5 if five else 8}.get(case, 8)
    assert got.bits == want.bits == expected_bits
    assert torch.equal(got.packed, want.packed) and torch.equal(got.scale, want.scale)
    assert (got.minimum is None) == (want.minimum is None)
    assert got.minimum is None or torch.equal(got.minimum, want.minimum)
    if how == "from_blocks" and qtype == Q.Q8_0 and got.bits == 8:
        assert w._ints is None  # moved natively: no integers decoded
    padding = got.packed.untyped_storage().nbytes() - got.packed.numel()
    assert padding >= layout.READ_PAD  # the kernel's reads past the last row stay in the buffer


@pytest.mark.real_model
def test_a_quantized_load_leaves_every_group_matrix_in_its_blocks(gemma_gguf) -> None:  # type: ignore[no-untyped-def]
    """The GGUF reader hands the model the bundled Gemma's Q8_0 / Q5_0 matrices undecoded (the
    load decodes each as it packs it), its row-permuted and fused ones included."""
    from freetoken.weights.gguf import load_gguf

    tensors = load_gguf(gemma_gguf, torch.bfloat16, keep_quantized=True).tensors
    groups = [t for t in tensors.values() if isinstance(t, QuantizedWeight)]
    assert len(groups) > 50 and all(isinstance(t, RawGroupBlocks) and t._ints is None for t in groups)
    assert {t.kind for t in groups} == {"Q8_0", "Q5_0"}


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
