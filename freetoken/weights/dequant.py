"""Dequantization of GGML tensor data into floating-point torch tensors.

Owns the block layouts of the GGML types FreeToken reads (F32, F16, BF16, Q8_0, Q5_0, Q5_1, Q4_0,
Q4_1, Q4_K, Q5_K, Q6_K, MXFP4) and their decoding, written as vectorised torch code so it runs on
any device. It knows nothing of tensor names, architectures or files: it is given raw bytes, a
type and a shape. Results are bit-identical to `gguf.quants.dequantize` (same float operations in
the same order).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import gguf
import numpy as np
import torch

from freetoken.errors import ModelLoadError

QType = gguf.GGMLQuantizationType

# Elements decoded per chunk: bounds the temporaries of one step (a few times this many floats).
CHUNK_ELEMENTS = 1 << 22

# MXFP4 (e2m1) code points, doubled so they are integers; the block scale is halved to match.
_MXFP4_VALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)


def _f16(b: torch.Tensor) -> torch.Tensor:
    """[n, 2] little-endian bytes -> [n, 1] float32."""
    return b.contiguous().view(torch.float16).to(torch.float32)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[n, k] bytes -> [n, 2k] uint8: the k low nibbles, then the k high nibbles."""
    return torch.cat((qs & 0x0F, qs >> 4), dim=-1)


def _bits(b: torch.Tensor, nbits: int = 8) -> torch.Tensor:
    """[n, k] bytes -> [n, k, nbits] uint8: bit i of each byte (LSB first) along the last axis."""
    shifts = torch.arange(nbits, dtype=torch.uint8, device=b.device)
    return (b.unsqueeze(-1) >> shifts) & 1


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    # block (34 B): d f16 | qs int8[32]
    d = _f16(blocks[:, :2])
    x = blocks[:, 2:].contiguous().view(torch.int8).to(torch.float32)
    return x * d


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    # block (18 B): d f16 | qs[16]; element j < 16 is the low nibble of qs[j], j >= 16 the high one
    d = _f16(blocks[:, :2])
    q = _nibbles(blocks[:, 2:]).to(torch.int8) - 8
    return d * q.to(torch.float32)


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    # block (20 B): d f16 | m f16 | qs[16]
    d = _f16(blocks[:, :2])
    m = _f16(blocks[:, 2:4])
    q = _nibbles(blocks[:, 4:]).to(torch.float32)
    return d * q + m


def _q5_high(qh: torch.Tensor) -> torch.Tensor:
    """[n, 4] bytes of a little-endian uint32 -> [n, 32] uint8: bit j of it, shifted to bit 4."""
    return _bits(qh).reshape(qh.shape[0], 32) << 4


def _q5_0(blocks: torch.Tensor) -> torch.Tensor:
    # block (22 B): d f16 | qh u32 (bit j = 5th bit of element j) | qs[16] as in Q4_0
    d = _f16(blocks[:, :2])
    q = (_nibbles(blocks[:, 6:]) | _q5_high(blocks[:, 2:6])).to(torch.int8) - 16
    return d * q.to(torch.float32)


def _q5_1(blocks: torch.Tensor) -> torch.Tensor:
    # block (24 B): d f16 | m f16 | qh u32 | qs[16]
    d = _f16(blocks[:, :2])
    m = _f16(blocks[:, 2:4])
    q = (_nibbles(blocks[:, 8:]) | _q5_high(blocks[:, 4:8])).to(torch.float32)
    return d * q + m


def _k_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 12 packed bytes of a Q4_K/Q5_K block -> 8 six-bit scales and 8 six-bit mins, [n, 8] each.

    Bytes 0-3 hold scales 0-3 (low 6 bits) and the top 2 bits of scales 4-7; bytes 4-7 hold mins
    0-3 and the top 2 bits of mins 4-7; bytes 8-11 hold the low 4 bits of scales 4-7 (low nibble)
    and of mins 4-7 (high nibble).
    """
    a, b, c = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = torch.cat((a & 0x3F, (c & 0x0F) | ((a >> 2) & 0x30)), dim=-1)
    mn = torch.cat((b & 0x3F, (c >> 4) | ((b >> 2) & 0x30)), dim=-1)
    return sc, mn


def _k_4bit(qs: torch.Tensor) -> torch.Tensor:
    """[n, 128] bytes -> [n, 8, 32] uint8: chunk c of 32 bytes gives sub-block 2c (low nibbles)
    and sub-block 2c + 1 (high nibbles)."""
    q = qs.reshape(-1, 4, 1, 32)
    q = torch.cat((q & 0x0F, q >> 4), dim=2)  # [n, 4, 2, 32]
    return q.reshape(-1, 8, 32)


def _q4_k(blocks: torch.Tensor) -> torch.Tensor:
    # super-block (144 B) of 256 = 8 x 32: d f16 | dmin f16 | scales[12] | qs[128]
    n = blocks.shape[0]
    d = _f16(blocks[:, 0:2])
    dmin = _f16(blocks[:, 2:4])
    sc, mn = _k_scales(blocks[:, 4:16])
    ds = (d * sc.to(torch.float32)).reshape(n, 8, 1)
    dm = (dmin * mn.to(torch.float32)).reshape(n, 8, 1)
    q = _k_4bit(blocks[:, 16:]).to(torch.float32)
    return (ds * q - dm).reshape(n, 256)


def _q5_k(blocks: torch.Tensor) -> torch.Tensor:
    # super-block (176 B): d f16 | dmin f16 | scales[12] | qh[32] | qs[128]; bit s of qh[l] is the
    # 5th bit of element l of sub-block s
    n = blocks.shape[0]
    d = _f16(blocks[:, 0:2])
    dmin = _f16(blocks[:, 2:4])
    sc, mn = _k_scales(blocks[:, 4:16])
    ds = (d * sc.to(torch.float32)).reshape(n, 8, 1)
    dm = (dmin * mn.to(torch.float32)).reshape(n, 8, 1)
    high = _bits(blocks[:, 16:48]).transpose(1, 2)  # [n, 32, 8] -> [n, 8 sub-blocks, 32]
    q = (_k_4bit(blocks[:, 48:]) | (high << 4)).to(torch.float32)
    return (ds * q - dm).reshape(n, 256)


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    # super-block (210 B) of 256 = 16 x 16: ql[128] | qh[64] | scales int8[16] | d f16.
    # Each half h (128 values) uses ql[64h:64h+64] and qh[32h:32h+32]; within it, quarter k (32
    # values) takes nibble k // 2 of ql[l + 32 (k % 2)] and bits 2k..2k+1 of qh[l].
    n = blocks.shape[0]
    ql = blocks[:, 0:128].reshape(n, 2, 1, 2, 32)
    low = torch.cat((ql & 0x0F, ql >> 4), dim=2).reshape(n, 2, 4, 32)  # [n, half, quarter, l]
    qh = blocks[:, 128:192].reshape(n, 2, 1, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=blocks.device).reshape(1, 1, 4, 1)
    high = (qh >> shifts) & 0x03  # [n, half, quarter, l]
    q = ((low | (high << 4)).to(torch.int8) - 32).reshape(n, 16, 16).to(torch.float32)
    scales = blocks[:, 192:208].contiguous().view(torch.int8).to(torch.float32)
    d = _f16(blocks[:, 208:210])
    return ((d * scales).reshape(n, 16, 1) * q).reshape(n, 256)


def _mxfp4(blocks: torch.Tensor) -> torch.Tensor:
    # block (17 B): e (E8M0 exponent) | qs[16] as in Q4_0, each nibble an index into _MXFP4_VALUES
    e = blocks[:, :1].to(torch.int32)
    # 2^(e - 128) as float32 bits; e < 2 gives a subnormal (0x00200000 << e)
    bits = torch.where(e < 2, torch.bitwise_left_shift(torch.full_like(e, 0x00200000), e), (e - 1) << 23)
    d = bits.view(torch.float32)
    table = torch.tensor(_MXFP4_VALUES, dtype=torch.float32, device=blocks.device)
    return d * table[_nibbles(blocks[:, 1:]).to(torch.int64)]


def _f32(blocks: torch.Tensor) -> torch.Tensor:
    return blocks.contiguous().view(torch.float32)


def _f16_elems(blocks: torch.Tensor) -> torch.Tensor:
    return blocks.contiguous().view(torch.float16).to(torch.float32)


def _bf16(blocks: torch.Tensor) -> torch.Tensor:
    return (blocks.contiguous().view(torch.int16).to(torch.int32) << 16).view(torch.float32)


_DECODERS: dict[QType, Callable[[torch.Tensor], torch.Tensor]] = {
    QType.F32: _f32,
    QType.F16: _f16_elems,
    QType.BF16: _bf16,
    QType.Q8_0: _q8_0,
    QType.Q4_0: _q4_0,
    QType.Q4_1: _q4_1,
    QType.Q5_0: _q5_0,
    QType.Q5_1: _q5_1,
    QType.Q4_K: _q4_k,
    QType.Q5_K: _q5_k,
    QType.Q6_K: _q6_k,
    QType.MXFP4: _mxfp4,
}

SUPPORTED_TYPES: frozenset[QType] = frozenset(_DECODERS)


def type_name(qtype: int) -> str:
    """The GGML name of a type id ("Q4_K"), or "type <id>" for an id this gguf package lacks."""
    try:
        return QType(qtype).name
    except ValueError:
        return f"type {int(qtype)}"


def _byte_view(raw: np.ndarray | torch.Tensor) -> np.ndarray | torch.Tensor:
    """The tensor's bytes as a flat uint8 array (no copy when already contiguous)."""
    if isinstance(raw, torch.Tensor):
        return raw.contiguous().reshape(-1).view(torch.uint8)
    return np.ascontiguousarray(raw).reshape(-1).view(np.uint8)


def dequantize(
    raw: np.ndarray | torch.Tensor,
    qtype: QType | int,
    shape: Sequence[int],
    name: str = "<unnamed>",
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Decode the GGML data of one tensor into a new tensor of `shape` (torch order, outermost
    first, i.e. the reverse of GGUF's ne) and `dtype`, computed in float32 on `device`.

    `raw` is the tensor's data as stored (uint8 blocks, or the typed view `gguf.GGUFReader`
    gives for float types); it is never written to and may be a read-only memory map. Decoding
    goes chunk by chunk, so peak memory is the output plus a few chunks. Raises ModelLoadError
    for a type without a decoder or bytes that do not match the shape.
    """
    if qtype not in _DECODERS:
        raise ModelLoadError(f"unsupported quant type {type_name(qtype)} for tensor {name}")
    qtype = QType(qtype)
    decode = _DECODERS[qtype]
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    shape = tuple(int(s) for s in shape)
    n_elements = int(np.prod(shape, dtype=np.int64))
    if shape and shape[-1] % block_size != 0:
        raise ModelLoadError(
            f"tensor {name}: row length {shape[-1]} is not a multiple of the {qtype.name} block size {block_size}"
        )
    n_blocks = n_elements // block_size
    data = _byte_view(raw)
    if data.shape[0] != n_blocks * type_size:
        raise ModelLoadError(
            f"tensor {name}: {data.shape[0]} bytes of {qtype.name} data, expected {n_blocks * type_size} for shape {list(shape)}"
        )
    out = torch.empty(n_elements, dtype=dtype, device=device)
    step = max(1, CHUNK_ELEMENTS // block_size)
    for first in range(0, n_blocks, step):
        last = min(n_blocks, first + step)
        chunk = data[first * type_size : last * type_size]
        if isinstance(chunk, np.ndarray):
            chunk = torch.from_numpy(chunk.copy())  # copy: the source may be a read-only memmap
        blocks = chunk.to(device).reshape(last - first, type_size)  # [blocks, bytes per block]
        out[first * block_size : last * block_size] = decode(blocks).reshape(-1)
    return out.reshape(shape)
