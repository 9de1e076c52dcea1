"""GGML block data -> the group-32 integer form the quantized linear layers run on.

Owns the exact translation of a GGUF matrix's blocks into a `QuantizedWeight` (integers, one
float16 scale and optionally one float16 minimum per 32 weights), so a quantized file stays
quantized in memory instead of being expanded to bfloat16:

- 8-bit form: Q8_0 and Q5_0 (symmetric; the kernel then reads it as 5 bits, see
  freetoken/ops/qlinear.py), Q5_1 and Q5_K (with a minimum) keep their integers
  exactly; Q6_K's 16-weight sub-blocks are requantized to 32-weight groups (absmax int8, so the
  error is at most half a step of an 8-bit grid over the group);
- 4-bit form: Q4_0 (minimum = -8 d), Q4_1 and Q4_K keep their nibbles exactly.

Scales that are a product in the file (the K-quants' d * sub-block scale) are rounded once to
float16. `to_superblocks` instead keeps a Q4_K or Q6_K matrix in its own integers (a
`SuperBlockWeight`: nothing rounded or requantized), which the linear layers run at the file's
bytes per weight. It reads block bytes only; it does not know tensor names or models. Types without a
translation here (float types, MXFP4) are the caller's to dequantize.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence

import gguf
import numpy as np
import torch

from freetoken.errors import ModelLoadError
from freetoken.ops.quantized import GROUP, SUPER, QuantizedWeight, RawGroupBlocks, RawSuperBlocks, SuperBlockWeight
from freetoken.weights.dequant import (
    _byte_view,
    _Constants,
    _f16,
    _fifth_bits,
    _k_scales,
    _nibbles,
    _q5,
    k_scale_ints,
    q6_k_ints,
    type_name,
)
from freetoken.weights.dequant import _q6_k as _decode_q6_k
from freetoken.weights.gguf_file import release_mapped_pages

QType = gguf.GGMLQuantizationType

# One chunk's worth of 32-weight groups: (q [n, 32] int8, scale [n] float32, minimum [n] float32 or None).
Groups = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]
# A translator reads [n, type_size] block bytes and returns the groups of those blocks, in order.
Translator = Callable[[torch.Tensor, _Constants], Groups]


def _q8_0(blocks: torch.Tensor, c: _Constants) -> Groups:
    # block (34 B): d f16 | qs int8[32]
    return blocks[:, 2:].view(torch.int8), _f16(blocks[:, :2])[:, 0], None


def _q5_0(blocks: torch.Tensor, c: _Constants) -> Groups:
    # block (22 B): d f16 | qh u32 | qs[16]; w = d (q - 16)
    q = _q5(blocks[:, 2:6], blocks[:, 6:], c).view(torch.int8)
    q -= 16
    return q, _f16(blocks[:, :2])[:, 0], None


def _q5_1(blocks: torch.Tensor, c: _Constants) -> Groups:
    # block (24 B): d f16 | m f16 | qh u32 | qs[16]; w = d q + m
    dm = _f16(blocks[:, :4])
    return _q5(blocks[:, 4:8], blocks[:, 8:], c).view(torch.int8), dm[:, 0], dm[:, 1]


def _q4_0(blocks: torch.Tensor, c: _Constants) -> Groups:
    # block (18 B): d f16 | qs[16]; w = d (q - 8) = d q + (-8 d)
    d = _f16(blocks[:, :2])[:, 0]
    return _nibbles(blocks[:, 2:]).view(torch.int8), d, -8 * d


def _q4_1(blocks: torch.Tensor, c: _Constants) -> Groups:
    # block (20 B): d f16 | m f16 | qs[16]
    dm = _f16(blocks[:, :4])
    return _nibbles(blocks[:, 4:]).view(torch.int8), dm[:, 0], dm[:, 1]


def _k_groups(q: torch.Tensor, blocks: torch.Tensor, c: _Constants) -> Groups:
    """Q4_K / Q5_K: q [n, 8, 32] -> groups with scale d * sc and minimum -dmin * m."""
    scales = _k_scales(blocks, c)  # [n, 2, 8, 1]: d * sc, dmin * m
    return q.reshape(-1, GROUP).view(torch.int8), scales[:, 0].reshape(-1), -scales[:, 1].reshape(-1)


def _q4_k(blocks: torch.Tensor, c: _Constants) -> Groups:
    n = blocks.shape[0]
    q = _nibbles(blocks[:, 16:].view(n, 4, 32)).view(n, 8, 32)
    return _k_groups(q, blocks, c)


def _q5_k(blocks: torch.Tensor, c: _Constants) -> Groups:
    n = blocks.shape[0]
    q = _nibbles(blocks[:, 48:].view(n, 4, 32)).view(n, 8, 32)
    high = _fifth_bits(blocks[:, 16:48], c).view(torch.uint8).view(n, 32, 8)  # [n, l, s]
    q |= high.transpose(1, 2)
    return _k_groups(q, blocks, c)


def _q6_k(blocks: torch.Tensor, c: _Constants) -> Groups:
    # Decoded exactly (as dequant does), then each 32 weights requantized to absmax int8.
    values = torch.empty(blocks.shape[0] * 256, dtype=torch.float32, device=blocks.device)
    _decode_q6_k(blocks, values, c)
    groups = values.view(-1, GROUP)  # [n * 8, 32]
    # Round the scale to its stored float16 first, so the integers are chosen for the scale used.
    scale = (groups.abs().amax(dim=1) / 127).half().float()
    q = torch.round(groups / scale.clamp(min=1e-30)[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale, None


_TRANSLATORS: dict[QType, tuple[int, Translator]] = {
    QType.Q8_0: (8, _q8_0),
    QType.Q5_0: (8, _q5_0),
    QType.Q5_1: (8, _q5_1),
    QType.Q5_K: (8, _q5_k),
    QType.Q6_K: (8, _q6_k),
    QType.Q4_0: (4, _q4_0),
    QType.Q4_1: (4, _q4_1),
    QType.Q4_K: (4, _q4_k),
}

INTEGER_TYPES: frozenset[QType] = frozenset(_TRANSLATORS)

# Blocks translated per chunk: bounds the float32 temporaries (Q6_K decodes a chunk in full).
_CHUNK_BLOCKS = 4096


def to_quantized(
    raw: np.ndarray | torch.Tensor, qtype: QType | int, shape: Sequence[int], name: str = "<unnamed>"
) -> QuantizedWeight:
    """The matrix of `shape` [N, K] stored as GGML `qtype` blocks in `raw`, in group-32 form.

    Raises ModelLoadError for a type without a translation, a shape that is not a matrix, or
    bytes that do not match the shape.
    """
    if qtype not in _TRANSLATORS:
        raise ModelLoadError(f"tensor {name}: {type_name(qtype)} has no integer form")
    qtype = QType(qtype)
    bits, translate = _TRANSLATORS[qtype]
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    if len(shape) != 2 or shape[1] % block_size != 0:
        raise ModelLoadError(f"tensor {name}: shape {list(shape)} is not a matrix of whole {qtype.name} blocks")
    N, K = int(shape[0]), int(shape[1])
    n_blocks = N * K // block_size
    data = _byte_view(raw)
    if data.shape[0] != n_blocks * type_size:
        raise ModelLoadError(
            f"tensor {name}: {data.shape[0]} bytes of {qtype.name} data, expected {n_blocks * type_size} for shape {list(shape)}"
        )
    groups = N * K // GROUP
    q = torch.empty(groups, GROUP, dtype=torch.int8)
    scale = torch.empty(groups, dtype=torch.float16)
    minimum: torch.Tensor | None = None
    constants = _Constants.on(torch.device("cpu"))
    per_block = block_size // GROUP
    for first in range(0, n_blocks, _CHUNK_BLOCKS):
        last = min(n_blocks, first + _CHUNK_BLOCKS)
        chunk = data[first * type_size : last * type_size]
        if isinstance(chunk, np.ndarray):
            chunk = torch.from_numpy(chunk.copy())  # the source is read-only
        gq, gs, gm = translate(chunk.view(last - first, type_size), constants)
        rows = slice(first * per_block, last * per_block)
        q[rows] = gq.reshape(-1, GROUP)
        scale[rows] = gs
        if gm is not None:
            if minimum is None:
                minimum = torch.empty(groups, dtype=torch.float16)
            minimum[rows] = gm
    return QuantizedWeight(
        bits=bits,
        q=q.view(N, K),
        scale=scale.view(N, K // GROUP),
        minimum=None if minimum is None else minimum.view(N, K // GROUP),
    )


SUPERBLOCK_TYPES: frozenset[QType] = frozenset({QType.Q4_K, QType.Q6_K})


# Rows converted per pass: a pass's temporaries (a copy of its bytes out of the read-only map,
# the integer unpacking's intermediates) are a few tens of MB, not a multiple of the whole matrix
# (a 262k-vocabulary head is ~100M weights).
ROWS_PER_PASS = 2048


def to_superblocks(
    raw: np.ndarray | torch.Tensor, qtype: QType | int, shape: Sequence[int], name: str = "<unnamed>"
) -> SuperBlockWeight:
    """The Q4_K or Q6_K matrix of `shape` [N, K] in `raw` as a SuperBlockWeight (exact), converted
    ROWS_PER_PASS rows at a time."""
    if qtype not in SUPERBLOCK_TYPES:
        raise ModelLoadError(f"tensor {name}: {type_name(qtype)} is not a super-block type")
    qtype = QType(qtype)
    n, k, rows = _block_rows(raw, qtype, shape, name)
    c = _Constants.on(torch.device("cpu"))
    parts = [
        _superblocks(rows(start, min(n, start + ROWS_PER_PASS)), qtype, k, c) for start in range(0, n, ROWS_PER_PASS)
    ]
    if len(parts) == 1:
        return parts[0]
    first = parts[0]

    def joined(field: str) -> torch.Tensor | None:
        if getattr(first, field) is None:
            return None
        out = torch.cat([getattr(p, field) for p in parts])
        for p in parts:
            setattr(p, field, None)  # each part's copy freed as soon as it is joined
        return out

    return SuperBlockWeight(first.kind, joined("q"), joined("sc"), joined("d"), joined("m"), joined("dmin"))


def superblock_rows(
    raw: np.ndarray | torch.Tensor, qtype: QType | int, shape: Sequence[int], name: str = "<unnamed>"
) -> RawSuperBlocks:
    """The Q4_K or Q6_K matrix of `shape` [N, K] in `raw` kept in its blocks, one row of blocks per
    matrix row (a read-only view of the memory map: no copy): packed for the kernel straight from
    them (ops/superblock.py), decoded by `to_superblocks` on first use anywhere else."""
    if qtype not in SUPERBLOCK_TYPES:
        raise ModelLoadError(f"tensor {name}: {type_name(qtype)} is not a super-block type")
    qtype = QType(qtype)
    n, k, _ = _block_rows(raw, qtype, shape, name)
    data = _byte_view(raw)
    if isinstance(data, np.ndarray):  # read-only map: viewed, never written (RawSuperBlocks' contract)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            data = torch.from_numpy(data)
    return RawSuperBlocks(
        "q4_k" if qtype == QType.Q4_K else "q6_k", [data.view(n, -1)], k, _decode_blocks, _release_blocks
    )


def group_rows(
    raw: np.ndarray | torch.Tensor, qtype: QType | int, shape: Sequence[int], name: str = "<unnamed>"
) -> RawGroupBlocks:
    """The matrix of `shape` [N, K] in `raw`, of a type `to_quantized` translates, kept in its
    blocks (a read-only view of the memory map: no copy): translated by `to_quantized` on first
    use, which is packing (ops/quantized.py `RawGroupBlocks`)."""
    if qtype not in _TRANSLATORS or qtype in SUPERBLOCK_TYPES:
        raise ModelLoadError(f"tensor {name}: {type_name(qtype)} has no group-32 form kept in its blocks")
    qtype = QType(qtype)
    n, k, _ = _block_rows(raw, qtype, shape, name)
    data = _byte_view(raw)
    if isinstance(data, np.ndarray):  # read-only map: viewed, never written (the translators copy)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            data = torch.from_numpy(data)
    bits = _TRANSLATORS[qtype][0]
    return RawGroupBlocks(bits, qtype.name, [data.view(n, -1)], k, _decode_group_blocks, _release_blocks)


def _decode_group_blocks(blocks: torch.Tensor, kind: str, k: int) -> QuantizedWeight:
    return to_quantized(blocks, QType[kind], (blocks.shape[0], k))


def _release_blocks(parts: list[torch.Tensor]) -> None:
    for p in parts:
        release_mapped_pages(p.data_ptr(), p.numel())


def _decode_blocks(blocks: torch.Tensor, kind: str, k: int) -> SuperBlockWeight:
    return to_superblocks(blocks, QType.Q4_K if kind == "q4_k" else QType.Q6_K, (blocks.shape[0], k))


def _block_rows(raw: np.ndarray | torch.Tensor, qtype: QType, shape: Sequence[int], name: str):  # type: ignore[no-untyped-def]
    """(N, K, rows) after the shape and size checks, where rows(a, b) is rows [a, b)'s blocks as a
    writable uint8 tensor [(b - a) * K / 256, type_size] (copied out of a read-only source)."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    if len(shape) != 2 or shape[1] % block_size != 0:
        raise ModelLoadError(f"tensor {name}: shape {list(shape)} is not a matrix of whole {qtype.name} blocks")
    n, k = int(shape[0]), int(shape[1])
    data = _byte_view(raw)
    if data.shape[0] != n * k // block_size * type_size:
        raise ModelLoadError(
            f"tensor {name}: {data.shape[0]} bytes of {qtype.name} data, expected {n * k // block_size * type_size} for shape {list(shape)}"
        )
    row_bytes = k // block_size * type_size

    def rows(a: int, b: int) -> torch.Tensor:
        part = data[a * row_bytes : b * row_bytes]
        t = torch.from_numpy(part.copy()) if isinstance(part, np.ndarray) else part
        return t.view(-1, type_size)

    return n, k, rows


def _superblocks(blocks: torch.Tensor, qtype: QType, k: int, c: _Constants) -> SuperBlockWeight:
    """Whole rows of super-blocks (uint8 [rows * K / 256, type_size]) as a SuperBlockWeight."""
    per_row = k // SUPER
    n = blocks.shape[0] // per_row
    d = blocks[:, 208:210] if qtype == QType.Q6_K else blocks[:, 0:2]
    d = d.contiguous().view(torch.float16).reshape(n, per_row)
    if qtype == QType.Q6_K:
        q, sc = q6_k_ints(blocks, c)
        return SuperBlockWeight("q6_k", q.reshape(n, k), sc.reshape(n, k // 16).contiguous(), d)
    q = _nibbles(blocks[:, 16:].reshape(-1, 4, 32)).view(torch.int8).reshape(n, k)
    ints = k_scale_ints(blocks, c)  # [n blocks, 2, 8]
    dmin = blocks[:, 2:4].contiguous().view(torch.float16).reshape(n, per_row)
    return SuperBlockWeight(
        "q4_k",
        q,
        ints[:, 0].reshape(n, k // GROUP).contiguous(),
        d,
        ints[:, 1].reshape(n, k // GROUP).contiguous(),
        dmin,
    )
