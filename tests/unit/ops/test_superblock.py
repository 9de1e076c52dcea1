"""Super-block (GGUF Q4_K / Q6_K) weights in their own integers: the loader's translation is exact
against gguf's own dequantization, the kernel layout round-trips, `sbmm` is within the stated bound
of dequantize + float64 matmul at every row count, fused projections of mixed types keep each
part's form, and slicing for tensor parallelism keeps the form. The native paths of the load
(csrc/repack.cpp: packing straight from the file's blocks, dequantizing the packed rows) are byte
for byte the torch ones, and a weight kept in its blocks (`RawSuperBlocks`) stays in them through
row slices, permutations and concatenation, decoding its integers only when something reads them;
once packed, the file pages it was read from no longer count as the process's resident memory.

Bound (as the group-32 kernel's, tests/unit/ops/test_qlinear_ops.py): activations quantized per
32-group, so |error| <= sum_k |w_k| amax_group(x) / 254, + 1e-5 |x|.|w| (float32 sums) + the
output's rounding (bf16: 2^-8 |r|).
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import quants

from freetoken.errors import ModelLoadError

from freetoken.ops import qlinear
from freetoken.ops.qlinear import PackedWeight, pack, superblock_kernel_available
from freetoken.ops.quantized import RawSuperBlocks, StackedWeight, SuperBlockWeight, concat, dequantize, quantize_int8
from freetoken.ops.superblock import PackedStack, PackedSuperBlock, pack_values, unpack_values
from freetoken.weights.requant import superblock_rows, to_superblocks

Q = gguf.GGMLQuantizationType
ROWS = (1, 2, 3, 5, 8, 9, 17, 64)
SHAPES = ((1, 256), (48, 256), (35, 768), (16, 2048), (7, 1280))  # (N, K): K % 512 == 256 too


def _blocks(qtype: Q, n: int, k: int, seed: int) -> np.ndarray:
    """Random block bytes of a [n, k] matrix (any byte pattern is a valid block, bar its float16
    scales, which are set to small positive values)."""
    rng = np.random.default_rng(seed)
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (n * k // block_size, type_size), dtype=np.uint8)
    for at in ((0, 2) if qtype == Q.Q4_K else (208,)):
        scales = (rng.random(raw.shape[0]) * 0.01).astype(np.float16)
        raw[:, at : at + 2] = np.frombuffer(scales.tobytes(), np.uint8).reshape(-1, 2)
    return raw.reshape(-1)


def _weight(kind: str, n: int, k: int, seed: int = 0) -> SuperBlockWeight:
    qtype = Q.Q4_K if kind == "q4_k" else Q.Q6_K
    return to_superblocks(_blocks(qtype, n, k, seed), qtype, (n, k))


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K])
def test_translation_is_exact(qtype: Q) -> None:
    raw = _blocks(qtype, 6, 1024, seed=1)
    w = to_superblocks(raw, qtype, (6, 1024))
    reference = quants.dequantize(raw.reshape(6, -1), qtype)  # gguf's own numpy dequantization
    assert np.array_equal(dequantize(w).numpy(), reference)


@pytest.mark.parametrize("kind", ["q4_k", "q6_k"])
@pytest.mark.parametrize("n,k", SHAPES)
def test_layout_round_trips(kind: str, n: int, k: int) -> None:
    w = _weight(kind, n, k)
    back = unpack_values(kind, *pack_values(w), k)
    for a, b in ((w.q, back.q), (w.sc, back.sc), (w.d, back.d), (w.m, back.m), (w.dmin, back.dmin)):
        assert (a is None and b is None) or torch.equal(a, b)


def _bound(x: torch.Tensor, w: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    m, k = x.shape
    amax = x.double().reshape(m, -1, 32).abs().amax(dim=2).repeat_interleave(32, dim=1)  # [M, K]
    out_rounding = 2.0**-8 if x.dtype == torch.bfloat16 else 1e-6
    return amax @ w.abs().t() / 254 + 1e-5 * (x.double().abs() @ w.abs().t()) + out_rounding * ref.abs() + 1e-30


@pytest.mark.skipif(not superblock_kernel_available(), reason="needs the super-block kernel (AVX-512 VNNI or AVX2)")
@pytest.mark.parametrize("kind", ["q4_k", "q6_k"])
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_within_bound(kind: str, n: int, k: int, dtype: torch.dtype) -> None:
    w = _weight(kind, n, k, seed=n + k)
    packed = pack(w)
    assert isinstance(packed, PackedSuperBlock)
    ref_w = dequantize(w, torch.float64)
    bias = torch.randn(n).to(dtype)
    for m in ROWS:
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
        y = qlinear(x, packed, bias)
        assert y.dtype == dtype and y.shape == (m, n)
        ref = x.double() @ ref_w.t() + bias.double()
        err = (y.double() - ref).abs()
        assert (err <= _bound(x, ref_w, ref)).all(), (m, (err / _bound(x, ref_w, ref)).max().item())


@pytest.mark.skipif(not superblock_kernel_available(), reason="needs the super-block kernel (AVX-512 VNNI or AVX2)")
@pytest.mark.parametrize("kind", ["q4_k", "q6_k"])
@pytest.mark.parametrize("n,k", [(35, 768), (37, 2048)])
def test_a_rows_output_is_the_same_bits_at_every_row_count(kind: str, n: int, k: int) -> None:
    """The kernel takes activation rows in passes of up to 8 (q6_k: 4) and weight rows one or two
    at a time, by M; each row's sums must not depend on that (the deterministic mode, speculation
    and the grouped expert call rely on it). Odd N leaves a weight row out of a pair."""
    packed = pack(_weight(kind, n, k, seed=7))
    x = torch.randn(17, k, generator=torch.Generator().manual_seed(3)).bfloat16()
    alone = torch.cat([qlinear(x[i : i + 1], packed) for i in range(17)])
    for m in (2, 3, 4, 5, 8, 9, 12, 17):
        assert torch.equal(qlinear(x[:m], packed), alone[:m]), m


@pytest.mark.skipif(not superblock_kernel_available(), reason="needs the super-block kernel (AVX-512 VNNI or AVX2)")
def test_bytes_per_weight_are_the_files() -> None:
    """Resident bytes within ~3% of the file's: Q4_K 0.5625 and Q6_K 0.8203 bytes per weight, also
    where a row ends in half a chunk (K = 768, an MoE expert's down projection: padded to whole
    chunks it was 1.33x the file's)."""
    for kind, file_bytes in (("q4_k", 144 / 256), ("q6_k", 210 / 256)):
        for k in (2048, 768, 256):
            packed = pack(_weight(kind, 64, k))
            per_weight = packed.nbytes / (64 * k)
            assert file_bytes <= per_weight <= file_bytes * 1.03 + 40 / 512 * (k % 512 != 0), (kind, k, per_weight)


@pytest.mark.skipif(not superblock_kernel_available(), reason="needs the super-block kernel (AVX-512 VNNI or AVX2)")
def test_rows_and_dequantize_are_exact() -> None:
    for kind in ("q4_k", "q6_k"):
        w = _weight(kind, 40, 768)
        packed = pack(w)
        ids = torch.tensor([[3, 0], [39, 3]])
        assert torch.equal(packed.rows(ids, torch.float32), dequantize(w)[ids])
        assert torch.equal(packed.dequantize(torch.float32), dequantize(w))


def test_concat_keeps_each_parts_form() -> None:
    q, k, v = _weight("q4_k", 32, 512, 1), _weight("q4_k", 16, 512, 2), _weight("q6_k", 16, 512, 3)
    same = concat([q, k])
    assert isinstance(same, SuperBlockWeight) and same.kind == "q4_k" and same.shape == (48, 512)
    mixed = concat([q, k, v])
    assert isinstance(mixed, StackedWeight)
    assert [p.kind for p in mixed.parts] == ["q4_k", "q6_k"]  # q and k merged into one row block
    assert torch.equal(dequantize(mixed), torch.cat([dequantize(q), dequantize(k), dequantize(v)]))
    g32 = quantize_int8(torch.randn(8, 512))
    assert [type(p) for p in concat([q, g32]).parts] == [SuperBlockWeight, type(g32)]


@pytest.mark.skipif(not superblock_kernel_available(), reason="needs the super-block kernel (AVX-512 VNNI or AVX2)")
def test_stacked_projection_matches_its_parts() -> None:
    q, v = _weight("q4_k", 32, 512, 1), _weight("q6_k", 16, 512, 3)
    g32 = quantize_int8(torch.randn(8, 512))
    packed = pack(concat([q, v, g32]))
    assert isinstance(packed, PackedStack) and packed.format == "q4_k + q6_k + int8"
    x = torch.randn(3, 512)
    parts = [qlinear(x, pack(q)), qlinear(x, pack(v)), qlinear(x, PackedWeight(g32))]
    bias = torch.randn(56)
    assert torch.equal(qlinear(x, packed, bias), torch.cat(parts, dim=1) + bias)
    assert torch.equal(packed.dequantize(torch.float32), dequantize(concat([q, v, g32])))


def test_slices_keep_the_form() -> None:
    w = _weight("q4_k", 12, 1024)
    assert torch.equal(dequantize(w.cols(256, 768)), dequantize(w)[:, 256:768])
    rows = w.map_rows(lambda t: t[4:9])
    assert torch.equal(dequantize(rows), dequantize(w)[4:9])
    with pytest.raises(ValueError):
        w.cols(32, 512)


def test_group32_fallback_is_close() -> None:
    """Without the kernel a super-block weight runs in the group-32 form: q4_k keeps its nibbles
    (scales rounded to float16), q6_k is requantized to absmax int8 per 32."""
    for kind in ("q4_k", "q6_k"):
        w = _weight(kind, 16, 512)
        exact, approx = dequantize(w), dequantize(w.to_group32())
        scale = exact.abs().reshape(16, -1, 32).amax(dim=2).repeat_interleave(32, dim=1)
        assert ((approx - exact).abs() <= scale / 254 + 2**-10 * exact.abs() + 1e-7).all()


def _raw(kind: str, n: int, k: int, seed: int = 0) -> tuple[RawSuperBlocks, SuperBlockWeight]:
    """The same random matrix kept in its blocks and decoded."""
    qtype = Q.Q4_K if kind == "q4_k" else Q.Q6_K
    blocks = _blocks(qtype, n, k, seed)
    return superblock_rows(blocks, qtype, (n, k)), to_superblocks(blocks, qtype, (n, k))


@pytest.mark.parametrize("kind", ["q4_k", "q6_k"])
@pytest.mark.parametrize("n,k", SHAPES)
def test_packing_from_the_blocks_is_the_packing_of_the_integers(kind: str, n: int, k: int) -> None:
    raw, ints = _raw(kind, n, k, seed=n * k)
    values, meta = pack_values(raw)
    assert raw._ints is None  # packed from the blocks, never decoded
    expected = pack_values(ints)
    assert torch.equal(values, expected[0]) and torch.equal(meta, expected[1])


@pytest.mark.skipif(not superblock_kernel_available(), reason="needs the super-block kernel (AVX-512 VNNI or AVX2)")
@pytest.mark.parametrize("kind", ["q4_k", "q6_k"])
@pytest.mark.parametrize("n,k", SHAPES)
def test_dequantized_rows_are_the_reference_bit_for_bit(kind: str, n: int, k: int) -> None:
    raw, ints = _raw(kind, n, k, seed=n + k)
    packed = pack(raw)
    assert isinstance(packed, PackedSuperBlock) and raw._ints is None
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        assert torch.equal(packed.dequantize(dtype), dequantize(ints, dtype))
        ids = torch.tensor([[n - 1, 0], [0, n // 2]])
        assert torch.equal(packed.rows(ids, dtype), dequantize(ints, dtype)[ids])
    lo, hi = n // 3, n - n // 3
    assert torch.equal(packed.rows_range(lo, hi, torch.bfloat16), dequantize(ints, torch.bfloat16)[lo:hi])


def test_a_weight_in_its_blocks_stays_there_until_its_integers_are_read() -> None:
    q, q_ints = _raw("q4_k", 8, 512, 1)
    k, k_ints = _raw("q4_k", 4, 512, 2)
    v, v_ints = _raw("q6_k", 4, 512, 3)
    order = torch.tensor([1, 0, 3, 2, 5, 4, 7, 6])
    permuted = q.map_rows(lambda t: t[order])
    padded = k.map_rows(lambda t: torch.cat([t, t.new_zeros(2, *t.shape[1:])]))  # TP's zero rows
    fused = concat([permuted, k, v])
    assert isinstance(permuted, RawSuperBlocks) and isinstance(padded, RawSuperBlocks) and isinstance(fused, StackedWeight)
    assert [type(p) for p in fused.parts] == [RawSuperBlocks, RawSuperBlocks] and fused.parts[0].shape == (12, 512)
    assert len(fused.parts[0].parts) == 2  # joined without copying the blocks
    if superblock_kernel_available():  # packed from the parts where they lie: the packing of the joined matrix
        joined = pack(fused.parts[0])
        assert torch.equal(joined.dequantize(), torch.cat([dequantize(q_ints)[order], dequantize(k_ints)]))
    assert q._ints is None and k._ints is None and v._ints is None
    # reading the integers decodes them, equal to the decoded matrix's
    assert torch.equal(dequantize(fused), torch.cat([dequantize(q_ints)[order], dequantize(k_ints), dequantize(v_ints)]))
    assert torch.equal(dequantize(padded), torch.cat([dequantize(k_ints), torch.zeros(2, 512)]))
    assert torch.equal(q.q, q_ints.q) and torch.equal(q.m, q_ints.m) and q._ints is not None
    assert torch.equal(dequantize(q.cols(256, 512)), dequantize(q_ints)[:, 256:512])
    decoded_then_sliced = q.map_rows(lambda t: t[2:5])  # once decoded, rows come from the integers
    assert not isinstance(decoded_then_sliced, RawSuperBlocks)
    assert torch.equal(dequantize(decoded_then_sliced), dequantize(q_ints)[2:5])
    with pytest.raises(ModelLoadError, match="bytes of Q4_K data"):
        superblock_rows(np.zeros(100, np.uint8), Q.Q4_K, (2, 512), "broken")


def _mapping_rss_kb(path: Path) -> int:
    """Resident kB of this process's mappings of `path` (/proc/self/smaps)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5:  # a mapping's header line
            inside = len(head) >= 6 and head[-1] == str(path)
        elif inside and line.startswith("Rss:"):
            total += int(head[1])
    return total


@pytest.mark.skipif(not superblock_kernel_available(), reason="needs the super-block kernel (AVX-512 VNNI or AVX2)")
def test_packing_drops_the_files_pages_it_read_and_never_a_copy(tmp_path: Path) -> None:
    """A packed matrix's blocks no longer count as resident memory of the process (they stay in
    the page cache); blocks that are not a file's (a copy) are left as they are."""
    from freetoken.weights.gguf_file import GGUFFile

    path = tmp_path / "blocks.gguf"
    blocks = _blocks(Q.Q6_K, 512, 2048, seed=7).reshape(512, -1)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("w", blocks, raw_dtype=Q.Q6_K)  # blocks [512, 8 * 210]: a [512, 2048] Q6_K matrix
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    reader = GGUFFile(path)
    info = reader.tensors[0]
    raw = superblock_rows(reader.tensor_data(info), Q.Q6_K, (512, 2048))
    touched = int(raw.parts[0].sum())  # reads every page of the tensor
    assert touched > 0 and _mapping_rss_kb(path) >= info.n_bytes // 1024 - 8
    packed = pack(raw)
    assert _mapping_rss_kb(path) < 64  # the header's pages at most
    assert torch.equal(packed.dequantize(), dequantize(to_superblocks(blocks.reshape(-1), Q.Q6_K, (512, 2048))))
    assert int(raw.parts[0].sum()) == touched  # read again: the same bytes, from the page cache

    copy, _ = _raw("q4_k", 64, 512, seed=9)
    copy = copy.map_rows(lambda t: t.clone())  # anonymous memory: never dropped (that would zero it)
    before = copy.parts[0].clone()
    pack(copy)
    assert torch.equal(copy.parts[0], before)
