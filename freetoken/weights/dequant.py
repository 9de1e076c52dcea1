"""Dequantization of GGML tensor data into floating-point torch tensors.

Owns the block layouts of the GGML types FreeToken reads (F32, F16, BF16, Q8_0, Q5_0, Q5_1, Q4_0,
Q4_1, Q4_K, Q5_K, Q6_K, MXFP4) and their decoding, written as vectorised torch code so it runs on
any device. It knows nothing of tensor names, architectures or files: it is given raw bytes, a
type and a shape. Results are bit-identical to `gguf.quants.dequantize` (same float operations in
the same order), then rounded once to the requested dtype. MXFP4 also converts exactly into the
8-bit group form the qlinear kernel reads (`mxfp4_to_int8`: ~2x the MXFP4 bytes, no rounding),
from HF's `*_blocks` / `*_scales` layout or GGUF's.

Speed on CPU: a tensor is decoded in chunks small enough that no torch op inside a chunk is split
across torch's intra-op threads (on a busy machine each split op can stall for milliseconds), and
the chunks are spread over a few Python threads instead (torch releases the GIL inside its ops).
Each decoder writes its float32 values into a buffer it is given (the output itself when that is
float32); nibbles and high bits are unpacked eight bytes at a time with int64 word ops, and the
integers are converted to float once, inside the multiply by the block scale.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import gguf
import numpy as np
import torch

from freetoken.errors import ModelLoadError
from freetoken.ops.quantized import QuantizedWeight

QType = gguf.GGMLQuantizationType
log = logging.getLogger(__name__)

# Elements decoded per chunk on CPU: below torch's intra-op grain size (32768), so every op in a
# chunk runs on the calling thread, and small enough for the temporaries to stay in cache.
CHUNK_ELEMENTS = 32768 - 256
# Elements per chunk on other devices (one stream, so larger steps mean fewer kernel launches).
DEVICE_CHUNK_ELEMENTS = 1 << 22

# MXFP4 (e2m1) code points, doubled so they are integers; the block scale is halved to match.
_MXFP4_VALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)
# The low nibble of each byte of an int64 word; the low two bits of each byte.
_LOW4 = 0x0F0F0F0F0F0F0F0F
_LOW2 = 0x0303030303030303


@dataclass(frozen=True)
class _Constants:
    """Small tensors the decoders index or broadcast against, made once per `dequantize` call."""

    spread: torch.Tensor  # [256] int64: byte k of entry x is 16 if bit k of x is set, else 0
    pair_shifts: torch.Tensor  # [1, 1, 4, 1] int64: 0, 2, 4, 6
    nibble_shifts: torch.Tensor  # [1, 2, 1] uint8: 0, 4
    mxfp4: torch.Tensor  # [16] float32: _MXFP4_VALUES

    @staticmethod
    def on(device: torch.device) -> _Constants:
        bits = (torch.arange(256, device=device).unsqueeze(1) >> torch.arange(8, device=device)) & 1
        return _Constants(
            spread=(bits * 16).to(torch.uint8).view(torch.int64).reshape(256),  # [256, 8] bytes -> words
            pair_shifts=torch.tensor([0, 2, 4, 6], device=device).reshape(1, 1, 4, 1),
            nibble_shifts=torch.tensor([0, 4], dtype=torch.uint8, device=device).reshape(1, 2, 1),
            mxfp4=torch.tensor(_MXFP4_VALUES, dtype=torch.float32, device=device),
        )


# A decoder reads [n, type_size] block bytes and writes the [n, block_size] float32 values.
Decoder = Callable[[torch.Tensor, torch.Tensor, _Constants], None]


def _f16(b: torch.Tensor) -> torch.Tensor:
    """[n, 2k] little-endian bytes (at an even offset, in rows of even stride) -> [n, k] float32."""
    return b.view(torch.float16).to(torch.float32)


def _words(b: torch.Tensor) -> torch.Tensor:
    """[..., 8k] bytes -> [..., k] int64 words. A slice of a single block row counts as
    contiguous but may start at any byte and keep the block's row stride (block sizes like
    Q6_K's 210 are not multiples of 8): it is copied then."""
    b = b.contiguous()
    if b.storage_offset() % 8 or any(stride % 8 for stride in b.stride()[:-1]):
        b = b.clone(memory_format=torch.contiguous_format)
    return b.view(torch.int64)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., k] bytes, k a multiple of 8 -> [..., 2k] uint8: the k low nibbles, then the k high
    nibbles. Unpacked eight bytes at a time in int64 words (byte-wide shifts are slow on CPU)."""
    w = _words(qs)  # [..., k / 8]
    q = torch.stack((w, w >> 4), dim=-2)  # [..., 2, k / 8]
    q &= _LOW4
    return q.view(torch.uint8).flatten(-2)


def _fifth_bits(qh: torch.Tensor, c: _Constants) -> torch.Tensor:
    """[n, k] bytes -> [n, k] int64 words: byte j of word i is 16 when bit j of qh[i] is set."""
    return c.spread[qh.to(torch.int64)]


def _q8_0(blocks: torch.Tensor, out: torch.Tensor, c: _Constants) -> None:
    # block (34 B): d f16 | qs int8[32]
    torch.mul(blocks[:, 2:].view(torch.int8), _f16(blocks[:, :2]), out=out)


def _q4_0(blocks: torch.Tensor, out: torch.Tensor, c: _Constants) -> None:
    # block (18 B): d f16 | qs[16]; element j < 16 is the low nibble of qs[j], j >= 16 the high one
    q = _nibbles(blocks[:, 2:]).view(torch.int8)
    q -= 8
    torch.mul(q, _f16(blocks[:, :2]), out=out)


def _q4_1(blocks: torch.Tensor, out: torch.Tensor, c: _Constants) -> None:
    # block (20 B): d f16 | m f16 | qs[16]
    dm = _f16(blocks[:, :4])
    torch.mul(_nibbles(blocks[:, 4:]), dm[:, :1], out=out)
    out += dm[:, 1:]


def _q5(qh: torch.Tensor, qs: torch.Tensor, c: _Constants) -> torch.Tensor:
    """qh [n, 4] (bit j = 5th bit of element j) and qs [n, 16] as in Q4_0 -> [n, 32] uint8."""
    q = _nibbles(qs)
    q.view(torch.int64).bitwise_or_(_fifth_bits(qh, c))
    return q


def _q5_0(blocks: torch.Tensor, out: torch.Tensor, c: _Constants) -> None:
    # block (22 B): d f16 | qh u32 | qs[16]
    q = _q5(blocks[:, 2:6], blocks[:, 6:], c).view(torch.int8)
    q -= 16
    torch.mul(q, _f16(blocks[:, :2]), out=out)


def _q5_1(blocks: torch.Tensor, out: torch.Tensor, c: _Constants) -> None:
    # block (24 B): d f16 | m f16 | qh u32 | qs[16]
    dm = _f16(blocks[:, :4])
    torch.mul(_q5(blocks[:, 4:8], blocks[:, 8:], c), dm[:, :1], out=out)
    out += dm[:, 1:]


def k_scale_ints(blocks: torch.Tensor, c: _Constants) -> torch.Tensor:
    """Bytes 0-15 of Q4_K/Q5_K blocks -> [n, 2, 8] uint8: each sub-block's 6-bit scale and 6-bit min.

    Bytes 0-3 hold d and dmin (f16). Of the 12 packed bytes that follow, bytes 4-7 hold scales 0-3
    (low 6 bits) and the top 2 bits of scales 4-7; bytes 8-11 mins 0-3 and the top 2 bits of mins
    4-7; bytes 12-15 the low 4 bits of scales 4-7 (low nibble) and of mins 4-7 (high nibble).
    """
    n = blocks.shape[0]
    ab = blocks[:, 4:12].view(n, 2, 4)  # scale bytes, min bytes
    packed = torch.empty(n, 2, 8, dtype=torch.uint8, device=blocks.device)
    torch.bitwise_and(ab, 0x3F, out=packed[:, :, :4])
    high = packed[:, :, 4:]
    torch.bitwise_right_shift(blocks[:, 12:16].view(n, 1, 4), c.nibble_shifts, out=high)
    high &= 0x0F
    high |= (ab >> 2) & 0x30
    return packed


def _k_scales(blocks: torch.Tensor, c: _Constants) -> torch.Tensor:
    """Bytes 0-15 of Q4_K/Q5_K blocks -> [n, 2, 8, 1] float32: d * scale_s and dmin * min_s."""
    n = blocks.shape[0]
    return torch.mul(k_scale_ints(blocks, c), _f16(blocks[:, 0:4]).view(n, 2, 1)).unsqueeze(-1)


def _k_apply(q: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> None:
    """out = (d * scale) * q - dmin * min, per sub-block of 32; q is [n, 8, 32] uint8."""
    values = out.view(q.shape)
    torch.mul(q, scales[:, 0], out=values)
    values -= scales[:, 1]


def _q4_k(blocks: torch.Tensor, out: torch.Tensor, c: _Constants) -> None:
    # super-block (144 B) of 256 = 8 x 32: d f16 | dmin f16 | scales[12] | qs[128]; chunk j of 32
    # bytes of qs gives sub-block 2j (low nibbles) and 2j + 1 (high nibbles)
    n = blocks.shape[0]
    q = _nibbles(blocks[:, 16:].view(n, 4, 32)).view(n, 8, 32)
    _k_apply(q, _k_scales(blocks, c), out)


def _q5_k(blocks: torch.Tensor, out: torch.Tensor, c: _Constants) -> None:
    # super-block (176 B): d f16 | dmin f16 | scales[12] | qh[32] | qs[128]; bit s of qh[l] is the
    # 5th bit of element l of sub-block s
    n = blocks.shape[0]
    q = _nibbles(blocks[:, 48:].view(n, 4, 32)).view(n, 8, 32)
    high = _fifth_bits(blocks[:, 16:48], c).view(torch.uint8).view(n, 32, 8)  # [n, l, s]
    q |= high.transpose(1, 2)
    _k_apply(q, _k_scales(blocks, c), out)


def q6_k_ints(blocks: torch.Tensor, c: _Constants) -> tuple[torch.Tensor, torch.Tensor]:
    """Q6_K super-blocks [n, 210] -> (q int8 [n, 256] in [-32, 31], scales int8 [n, 16]); d is
    the f16 at bytes 208-209.

    A super-block (210 B) of 256 = 16 x 16: ql[128] | qh[64] | scales int8[16] | d f16. Each half h
    (128 values) uses ql[64h:64h+64] and qh[32h:32h+32]; within it, quarter k (32 values) takes
    nibble k // 2 of ql[l + 32 (k % 2)] and bits 2k..2k+1 of qh[l]."""
    n = blocks.shape[0]
    q = _nibbles(blocks[:, 0:128].view(n, 2, 64)).view(n, 2, 4, 32)  # [n, half, quarter k, l]
    qh = _words(blocks[:, 128:192]).view(n, 2, 1, 4)  # [n, half, 1, words]
    high = (qh >> c.pair_shifts) & _LOW2  # [n, half, quarter k, words]: bits 2k..2k+1 of each byte
    high <<= 4
    q.view(torch.int64).view(n, 2, 4, 4).bitwise_or_(high)
    q = q.view(torch.int8)
    q -= 32
    return q.view(n, 256), blocks[:, 192:208].view(torch.int8)


def _q6_k(blocks: torch.Tensor, out: torch.Tensor, c: _Constants) -> None:
    n = blocks.shape[0]
    q, sc = q6_k_ints(blocks, c)
    ds = torch.mul(_f16(blocks[:, 208:210]), sc)  # [n, 16] float32
    torch.mul(ds.unsqueeze(-1), q.view(n, 16, 16), out=out.view(n, 16, 16))


def _mxfp4(blocks: torch.Tensor, out: torch.Tensor, c: _Constants) -> None:
    # block (17 B): e (E8M0 exponent) | qs[16] as in Q4_0, each nibble an index into _MXFP4_VALUES
    e = blocks[:, :1].to(torch.int32)
    # 2^(e - 128) as float32 bits; e < 2 gives a subnormal (0x00200000 << e)
    bits = torch.where(e < 2, torch.bitwise_left_shift(torch.full_like(e, 0x00200000), e), (e - 1) << 23)
    values = c.mxfp4[_nibbles(blocks[:, 1:]).to(torch.int64)]
    torch.mul(bits.view(torch.float32), values, out=out)


def _f32(blocks: torch.Tensor, out: torch.Tensor, c: _Constants) -> None:
    out.copy_(blocks.view(torch.float32))


def _f16_elems(blocks: torch.Tensor, out: torch.Tensor, c: _Constants) -> None:
    out.copy_(blocks.view(torch.float16))


def _bf16(blocks: torch.Tensor, out: torch.Tensor, c: _Constants) -> None:
    out.copy_(blocks.view(torch.bfloat16))  # exact: a bfloat16 is the top half of a float32


_DECODERS: dict[QType, Decoder] = {
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


def _byte_view(raw: np.ndarray | torch.Tensor) -> torch.Tensor | np.ndarray:
    """The tensor's bytes as a flat uint8 torch tensor (no copy when already contiguous and
    writable), or a flat uint8 numpy array for read-only input (copied chunk by chunk later)."""
    if isinstance(raw, torch.Tensor):
        data = raw.contiguous().reshape(-1).view(torch.uint8)
        # the decoders view block fields as float16 / float32: keep the base 4-byte aligned
        return data if data.storage_offset() % 4 == 0 else data.clone()
    flat = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    return torch.from_numpy(flat) if flat.flags.writeable and flat.ctypes.data % 4 == 0 else flat


def _chunk_elements(device: torch.device) -> int:
    return CHUNK_ELEMENTS if device.type == "cpu" else DEVICE_CHUNK_ELEMENTS


def dequantize(
    raw: np.ndarray | torch.Tensor,
    qtype: QType | int,
    shape: Sequence[int],
    name: str = "<unnamed>",
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
    threads: int | None = None,
) -> torch.Tensor:
    """Decode the GGML data of one tensor into a new tensor of `shape` (torch order, outermost
    first, i.e. the reverse of GGUF's ne) and `dtype`, computed in float32 on `device`.

    `raw` is the tensor's data as stored (uint8 blocks, or a typed view for float types); it is
    never written to and may be a read-only memory map. Decoding goes chunk by chunk, so peak
    memory is the output plus a few chunks; on CPU the chunks are shared among `threads` Python
    threads (default: torch's intra-op thread count). Raises ModelLoadError for a type without a
    decoder or bytes that do not match the shape.
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
    constants = _Constants.on(out.device)
    step = max(1, _chunk_elements(out.device) // block_size)

    def run(first: int) -> None:
        last = min(n_blocks, first + step)
        chunk = data[first * type_size : last * type_size]
        if isinstance(chunk, np.ndarray):
            chunk = torch.from_numpy(chunk.copy())  # copy: the source is read-only
        blocks = chunk.to(out.device).view(last - first, type_size)  # [blocks, bytes per block]
        target = out[first * block_size : last * block_size].view(last - first, block_size)
        if dtype == torch.float32:
            decode(blocks, target, constants)
        else:  # decode in float32, then round once
            values = torch.empty(target.shape, dtype=torch.float32, device=out.device)
            decode(blocks, values, constants)
            target.copy_(values)

    def run_all(starts: range) -> None:
        for first in starts:
            run(first)

    starts = range(0, n_blocks, step)
    workers = 1 if out.device.type != "cpu" else min(len(starts), threads or torch.get_num_threads())
    if workers <= 1:
        run_all(starts)
    else:  # one task per thread, each taking every workers-th chunk
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="dequantize") as pool:
            list(pool.map(run_all, [starts[k::workers] for k in range(workers)]))  # list(): re-raises
    return out.reshape(shape)


@dataclass(frozen=True)
class Deferred:
    """A matrix decoded only when asked (`make()`): one expert of a stacked GGUF tensor, whose
    bytes stay in the memory-mapped file until then. `shape` is the matrix's [N, K], `nbytes`
    its stored size."""

    shape: tuple[int, int]
    nbytes: int
    make: Callable[[], torch.Tensor | QuantizedWeight]


# MXFP4 block exponents whose halved power of two, and 12 times it, are exact float16 values:
# scale = 2^(e - 128) needs e >= 104 (2^-24, the smallest subnormal) and minimum = -12 * scale =
# -3 * 2^(e - 126) needs e <= 140 (3 * 2^14 <= 65504).
MXFP4_EXACT_EXPONENTS = (104, 140)


def _mxfp4_pair_table() -> torch.Tensor:
    """[256] int16: for a byte holding codes lo | hi << 4, the int8 pair (q(lo), q(hi)) in
    memory order, q(c) = 2 v(c) + 12."""
    q = torch.tensor(_MXFP4_VALUES, dtype=torch.int16) + 12
    byte = torch.arange(256)
    return q[byte & 15] | (q[byte >> 4] << 8)


_MXFP4_PAIRS = _mxfp4_pair_table()  # read-only


def mxfp4_q(qs: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """MXFP4 code bytes uint8 [..., G, 16] -> q int8 [..., G * 32] in [0, 24] (q = 2v + 12), one
    table lookup per byte. `interleaved`: byte j holds elements 2j (low nibble) and 2j + 1 (HF,
    as transformers' `convert_moe_packed_tensors` reads them); else j and j + 16 (GGUF)."""
    pairs = _MXFP4_PAIRS.to(qs.device)[qs.to(torch.int64)].view(torch.int8)  # [..., G, 32]: lo, hi per byte
    if not interleaved:
        pairs = pairs.unflatten(-1, (16, 2)).transpose(-1, -2)  # [..., G, 2, 16]: the lows, then the highs
    return pairs.reshape(*qs.shape[:-2], qs.shape[-2] * 32)


def mxfp4_to_int8(q: torch.Tensor, exponents: torch.Tensor) -> QuantizedWeight | None:
    """One MXFP4 matrix as the exact 8-bit group form, or None when a block that is not all zeros
    has an exponent outside MXFP4_EXACT_EXPONENTS (the caller dequantizes that matrix instead).

    `q` int8 [N, K] from `mxfp4_q`, `exponents` uint8 [N, K / 32] the e8m0 block exponents. Value
    = v * 2^(e - 127) with v in +-{0, .5, ..., 6}, i.e. with q = 2v + 12 in [0, 24]: q * scale +
    minimum, scale = 2^(e - 128), minimum = -12 * scale.
    """
    n, k = q.shape
    e = exponents.to(torch.int32)
    lo, hi = MXFP4_EXACT_EXPONENTS
    outside = (e < lo) | (e > hi)  # [N, G]
    if bool(outside.any()):  # only blocks of zeros may have such an exponent: they get scale 0
        zero_block = (q.view(n, k // 32, 32) == 12).all(dim=2)
        if bool((outside & ~zero_block).any()):
            return None
        e = torch.where(outside, 0, e)
    scale = torch.ldexp(torch.ones_like(e, dtype=torch.float32), e - 128).half()  # 0 where e was zeroed
    return QuantizedWeight(bits=8, q=q, scale=scale, minimum=-12 * scale)


def mxfp4_float(q: torch.Tensor, exponents: torch.Tensor) -> torch.Tensor:
    """The reference values of an MXFP4 matrix (q [N, K] from `mxfp4_q`, exponents [N, K / 32])
    -> float32 [N, K]."""
    return (q.float() - 12) * torch.exp2(exponents.float() - 128).repeat_interleave(32, dim=1)


def mxfp4_matrix(q: torch.Tensor, exponents: torch.Tensor, name: str) -> QuantizedWeight | torch.Tensor:
    """`mxfp4_to_int8`, or float32 values (logged) where the exponents do not fit float16."""
    qw = mxfp4_to_int8(q, exponents)
    if qw is not None:
        return qw
    log.warning(
        "%s: MXFP4 block exponents outside %s cannot stay packed; dequantized to float", name, MXFP4_EXACT_EXPONENTS
    )
    return mxfp4_float(q, exponents)


def gguf_mxfp4_blocks(raw: np.ndarray | torch.Tensor, rows: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A GGUF MXFP4 matrix's bytes -> (q int8 [rows, k], exponents uint8 [rows, k / 32]); a block
    is e | qs[16], element j < 16 the low nibble of qs[j], j >= 16 the high one."""
    data = _byte_view(raw)
    blocks = (data if isinstance(data, torch.Tensor) else torch.from_numpy(data.copy())).view(rows, k // 32, 17)
    return mxfp4_q(blocks[..., 1:], interleaved=False), blocks[..., 0].contiguous()
