"""Dequantization against the gguf package's numpy reference, bit for bit.

Real tensors come from the two bundled files (F32, Q8_0, Q5_0, Q4_K, Q6_K, Q4_1). The types they
lack are tested on data made by `gguf.quants.quantize` where it can quantize them (F16, BF16,
Q4_0, Q5_1, MXFP4). It cannot quantize K-quants, so Q5_K (in no bundled file) is tested, like
every block type, on random block bytes with valid f16 scale fields: every bit pattern of the
quant fields is a valid block, so this exercises the whole bit layout.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from freetoken.errors import ModelLoadError
from freetoken.weights.dequant import SUPPORTED_TYPES, dequantize
from block_data import F16_FIELDS, block_bytes

Q = gguf.GGMLQuantizationType


def reference(raw: np.ndarray, qtype: Q, shape: tuple[int, ...]) -> torch.Tensor:
    out = gguf.quants.dequantize(raw, qtype)
    return torch.from_numpy(np.array(out, dtype=np.float32)).reshape(shape)


def torch_shape(t: gguf.ReaderTensor) -> tuple[int, ...]:
    return tuple(int(x) for x in reversed(t.shape.tolist()))


def sample_tensors(reader: gguf.GGUFReader, per_type: int = 2) -> list[gguf.ReaderTensor]:
    """A few tensors of each type in the file, the smallest ones first (keeps the test fast)."""
    chosen: list[gguf.ReaderTensor] = []
    by_type: dict[int, list[gguf.ReaderTensor]] = {}
    for t in reader.tensors:
        by_type.setdefault(int(t.tensor_type), []).append(t)
    for tensors in by_type.values():
        chosen.extend(sorted(tensors, key=lambda t: int(t.n_elements))[:per_type])
    return chosen


@pytest.mark.real_model
@pytest.mark.parametrize("which", ["gemma", "smollm2"])
def test_real_tensors_match_reference(which: str, request: pytest.FixtureRequest) -> None:
    reader = request.getfixturevalue(f"{which}_reader")
    seen = set()
    for t in sample_tensors(reader):
        shape = torch_shape(t)
        got = dequantize(t.data, t.tensor_type, shape, t.name)
        assert got.dtype == torch.float32 and tuple(got.shape) == shape
        assert torch.equal(got, reference(t.data, t.tensor_type, shape)), t.name
        seen.add(t.tensor_type.name)
    expected = {"F32", "Q8_0", "Q5_0", "Q4_K", "Q6_K"} if which == "gemma" else {"F32", "Q8_0", "Q4_1"}
    assert seen == expected


@pytest.mark.real_model
def test_real_q8_0_embedding_in_small_chunks(gemma_reader: gguf.GGUFReader, monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunk boundaries (here not a multiple of a row) do not change the result."""
    import freetoken.weights.dequant as dq

    t = next(t for t in gemma_reader.tensors if t.name == "token_embd.weight")
    rows = t.data[:300]  # 300 vocabulary rows, 640 wide
    monkeypatch.setattr(dq, "CHUNK_ELEMENTS", 32 * 7)
    got = dq.dequantize(rows, t.tensor_type, (300, 640), t.name)
    assert torch.equal(got, reference(rows, t.tensor_type, (300, 640)))


@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.MXFP4])
def test_synthetic_quantized_tensors(qtype: Q) -> None:
    rng = np.random.default_rng(int(qtype))
    values = rng.standard_normal((48, 256)).astype(np.float32) * rng.uniform(0.01, 4.0, (48, 1)).astype(np.float32)
    values[3] = 0.0  # an all-zero block row
    raw = gguf.quants.quantize(values, qtype)
    got = dequantize(raw, qtype, values.shape, "synthetic")
    want = reference(raw, qtype, values.shape)
    assert torch.equal(got, want)
    # the reference really decodes something close to the input (so the comparison is not vacuous)
    assert torch.allclose(want, torch.from_numpy(values), atol=0.5 * float(np.abs(values).max()))


@pytest.mark.parametrize("qtype", sorted(F16_FIELDS, key=int))
def test_random_block_bytes(qtype: Q) -> None:
    raw, shape = block_bytes(qtype, seed=100 + int(qtype))
    assert torch.equal(dequantize(raw, qtype, shape, "random"), reference(raw, qtype, shape))


def test_mxfp4_every_exponent() -> None:
    raw = np.zeros((253, 17), dtype=np.uint8)
    raw[:, 0] = np.arange(253, dtype=np.uint8)  # from 253 on, 12 * 2^(e - 128) overflows float32
    raw[:, 1:] = np.random.default_rng(0).integers(0, 256, (253, 16), dtype=np.uint8)
    shape = (253, 32)
    assert torch.equal(dequantize(raw, Q.MXFP4, shape, "mx"), reference(raw, Q.MXFP4, shape))


def test_output_dtype_and_torch_input() -> None:
    values = np.random.default_rng(1).standard_normal((8, 64)).astype(np.float32)
    raw = gguf.quants.quantize(values, Q.Q8_0)
    got = dequantize(torch.from_numpy(raw), Q.Q8_0, (8, 64), "t", dtype=torch.bfloat16)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, reference(raw, Q.Q8_0, (8, 64)).to(torch.bfloat16))


def test_f32_result_is_a_copy() -> None:
    values = np.arange(64, dtype=np.float32).reshape(2, 32)
    got = dequantize(values, Q.F32, (2, 32), "f")
    got += 1
    assert values[0, 0] == 0.0


def test_supported_types_cover_the_issue_list() -> None:
    assert {Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q5_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q6_K} <= SUPPORTED_TYPES


def test_unsupported_type_names_type_and_tensor() -> None:
    with pytest.raises(ModelLoadError, match=r"unsupported quant type IQ2_XXS for tensor blk\.0\.ffn_up\.weight"):
        dequantize(np.zeros(66, dtype=np.uint8), Q.IQ2_XXS, (256,), "blk.0.ffn_up.weight")
    with pytest.raises(ModelLoadError, match="unsupported quant type type 999"):
        dequantize(np.zeros(4, dtype=np.uint8), 999, (1,), "x")


def test_size_mismatch_is_a_load_error() -> None:
    with pytest.raises(ModelLoadError, match="expected 68"):
        dequantize(np.zeros(34, dtype=np.uint8), Q.Q8_0, (2, 32), "short")
    with pytest.raises(ModelLoadError, match="not a multiple"):
        dequantize(np.zeros(34, dtype=np.uint8), Q.Q8_0, (1, 31), "ragged")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("qtype", sorted(F16_FIELDS, key=int) + [Q.MXFP4, Q.BF16, Q.F16])
def test_cuda_matches_cpu(qtype: Q) -> None:
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(200 + int(qtype))
    raw = rng.integers(0, 256, (32, type_size * 8), dtype=np.uint8)
    for offset in F16_FIELDS.get(qtype, []):
        for b in range(8):
            scales = rng.uniform(-2.0, 2.0, 32).astype(np.float16)
            raw[:, b * type_size + offset : b * type_size + offset + 2] = scales.view(np.uint8).reshape(32, 2)
    if qtype in (Q.BF16, Q.F16):
        raw = rng.standard_normal((32, 8 * type_size // 2)).astype(np.float16).view(np.uint8)
    shape = (32, 8 * block_size)
    got = dequantize(raw, qtype, shape, "cuda", device="cuda")
    assert got.device.type == "cuda"
    assert torch.equal(got.cpu(), dequantize(raw, qtype, shape, "cpu"))


def random_blocks(qtype: Q, n_blocks: int, seed: int) -> np.ndarray:
    """[n_blocks, type_size] random block bytes with finite f16 scale fields."""
    _, type_size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (n_blocks, type_size), dtype=np.uint8)
    for offset in F16_FIELDS.get(qtype, []):
        raw[:, offset : offset + 2] = rng.uniform(-2.0, 2.0, n_blocks).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return raw


@pytest.mark.parametrize("qtype", sorted(F16_FIELDS, key=int) + [Q.MXFP4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_narrow_output_is_the_reference_rounded_once(qtype: Q, dtype: torch.dtype) -> None:
    block_size, _ = gguf.GGML_QUANT_SIZES[qtype]
    raw = random_blocks(qtype, 40, 300 + int(qtype))
    shape = (8, 5 * block_size)
    got = dequantize(raw, qtype, shape, "narrow", dtype=dtype)
    assert got.dtype == dtype
    assert torch.equal(got, reference(raw, qtype, shape).to(dtype))


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q5_0, Q.Q4_K, Q.Q6_K])
def test_chunks_threads_and_read_only_input_do_not_change_the_result(qtype: Q, monkeypatch: pytest.MonkeyPatch) -> None:
    """Many chunks shared by several threads, from a read-only array (copied chunk by chunk) and
    from a writable one (viewed in place), give the single-chunk result."""
    import freetoken.weights.dequant as dq

    block_size, _ = gguf.GGML_QUANT_SIZES[qtype]
    raw = random_blocks(qtype, 96, 400 + int(qtype))
    shape = (12, 8 * block_size)
    want = reference(raw, qtype, shape)
    monkeypatch.setattr(dq, "CHUNK_ELEMENTS", 3 * block_size)  # 32 chunks
    read_only = raw.copy()
    read_only.flags.writeable = False
    for data in (raw, read_only):
        for threads in (1, 3):
            assert torch.equal(dq.dequantize(data, qtype, shape, "chunked", threads=threads), want)
    assert np.array_equal(read_only, raw)  # never written


@pytest.mark.parametrize("qtype", sorted(F16_FIELDS, key=int))
def test_a_chunk_of_one_block_at_an_odd_offset(qtype: Q, monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks of 3 blocks over 7: the last chunk is one block, which starts at a byte offset that
    is not a multiple of 8 for most types (Q6_K's blocks are 210 bytes)."""
    import freetoken.weights.dequant as dq

    block_size, _ = gguf.GGML_QUANT_SIZES[qtype]
    monkeypatch.setattr(dq, "CHUNK_ELEMENTS", 3 * block_size)
    raw, _ = block_bytes(qtype, seed=500 + int(qtype), n_blocks=8)
    raw = raw.reshape(-1)[: 7 * gguf.GGML_QUANT_SIZES[qtype][1]]
    shape = (7, block_size)
    assert torch.equal(dq.dequantize(raw, qtype, shape, "odd", threads=1), reference(raw, qtype, shape))
