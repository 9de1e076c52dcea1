"""The byte layouts of the quantized matmul kernel (csrc/qlinear.cpp), in plain torch: packing
group-32 integers into the kernel's rows and the exact inverse.

Owns the chunk-transposed word order (within each chunk of 16 groups, int32 lane l of every
vector belongs to group l), the bits-4 nibble packing, the bits-5 fifth-bit masks and the read
padding. It does not choose formats or paths (qlinear.py) and knows no file format.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from freetoken.ops.quantized import GROUP

# Bytes the kernel may read past a packed weight's end (kReadPad in csrc/qlinear.cpp).
READ_PAD = 64


def _chunk_transpose(u: torch.Tensor, inverse: bool) -> torch.Tensor:
    """The kernel's byte order within each chunk of 16 groups (csrc/qlinear.cpp): group-major
    [l][v][b] <-> vector-major [v][l][b] (l: group in chunk, v: 4-byte word in group, b: byte);
    the last chunk may hold fewer than 16 groups. uint8 [R, K] -> uint8 [R, K]."""
    r, k = u.shape
    full = (k // GROUP // 16) * 16 * GROUP  # bytes of the full chunks
    body = u[:, :full].reshape(r, -1, 16, 8, 4) if not inverse else u[:, :full].reshape(r, -1, 8, 16, 4)
    parts = [body.transpose(2, 3).reshape(r, full)]
    if full < k:
        nb = (k - full) // GROUP
        tail = u[:, full:].reshape(r, nb, 8, 4) if not inverse else u[:, full:].reshape(r, 8, nb, 4)
        parts.append(tail.transpose(1, 2).reshape(r, k - full))
    return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]


def _compact_tail(k: int) -> bool:
    """Whether the last chunk holds nb < 16 groups with nb dividing 16 (K = 576, 640, ...): the
    kernel then reads its 8-bit word stream as contiguous vectors, and bits 4 pack that stream."""
    nb = (k // GROUP) % 16
    return nb > 0 and 16 % nb == 0


def _pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """int8 [N, K] -> the kernel's uint8 rows (csrc/qlinear.cpp): bits 8, q + 128 [N, K]; bits 4,
    [N, K / 2]: in a full chunk, vector u holds words v = 2u (low nibbles) and 2u + 1 (high); a
    compact last chunk packs its 8-bit stream in blocks of B = min(128, bytes): byte i = blk[i] |
    blk[B / 2 + i] << 4; another last chunk is packed like a full one. bits 5 (q in [-16, 15]):
    the bits-4 packing of (q + 16)'s low nibbles, each chunk followed by its fifth-bit masks."""
    if bits == 8:
        return _chunk_transpose(q.view(torch.uint8) ^ 128, inverse=False).contiguous()
    if bits == 5:
        return _pack5(q)
    t = _chunk_transpose(q.to(torch.uint8), inverse=False)  # vector-major words v = 0..7
    r, k = t.shape
    out = []
    for lo, n_groups in _chunks(k):
        words = t[:, lo : lo + n_groups * GROUP]
        if n_groups < 16 and _compact_tail(k):
            block = min(128, n_groups * GROUP)
            halves = words.reshape(r, -1, 2, block // 2)  # [R, blocks, lo/hi, B / 2]
            out.append((halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(r, -1))
        else:
            words = words.reshape(r, 4, 2, n_groups * 4)  # [R, u, v % 2, bytes]
            out.append((words[:, :, 0] | (words[:, :, 1] << 4)).reshape(r, -1))
    return torch.cat(out, dim=1).contiguous()


def _value_vectors(t: torch.Tensor, k: int, lo: int, n_groups: int) -> torch.Tensor:
    """The weight bytes of one chunk of the vector-major stream t [R, K] as the kernel's vpdpbusd
    takes them, 64 per vector (zero where a short vector has no weight): [R, vectors, 64]."""
    r = t.shape[0]
    words = t[:, lo : lo + n_groups * GROUP]
    if n_groups == 16:
        return words.reshape(r, 8, 64)
    if _compact_tail(k):  # one contiguous stream, read 64 bytes at a time
        n = n_groups * GROUP
        return F.pad(words, (0, -n % 64)).reshape(r, -1, 64)
    return F.pad(words.reshape(r, 8, n_groups * 4), (0, 64 - n_groups * 4))  # 8 vectors of nb * 4


def _pack5(q: torch.Tensor) -> torch.Tensor:
    """q int8 [N, K] in [-16, 15] -> bits-5 rows: per chunk, the bits-4 bytes of the low nibbles
    of q + 16, then one little-endian 64-bit mask per value vector (bit i: the fifth bit of the
    vector's byte i)."""
    u = (q + 16).to(torch.uint8)
    r, k = u.shape
    nibbles = _pack((u & 15).view(torch.int8), 4)  # [N, K / 2]
    t = _chunk_transpose(u, inverse=False)
    weights = (1 << torch.arange(8, dtype=torch.int32)).to(torch.uint8)
    out = []
    for lo, n_groups in _chunks(k):
        fifth = (_value_vectors(t, k, lo, n_groups) >> 4) & 1  # [R, vectors, 64]
        masks = (fifth.reshape(r, -1, 8) * weights).sum(dim=2, dtype=torch.int32).to(torch.uint8)  # [R, vectors * 8]
        out += [nibbles[:, lo // 2 : lo // 2 + n_groups * 16], masks.reshape(r, -1)]
    return torch.cat(out, dim=1).contiguous()


def _unpack5(p: torch.Tensor, k: int) -> torch.Tensor:
    """Inverse of _pack5: bits-5 rows -> int8 [R, K] in [-16, 15]."""
    r = p.shape[0]
    nibble_parts, mask_parts, at = [], [], 0
    for lo, n_groups in _chunks(k):
        n_masks = _masks_of(n_groups, k)
        nibble_parts.append(p[:, at : at + n_groups * 16])
        mask_parts.append(p[:, at + n_groups * 16 : at + n_groups * 16 + 8 * n_masks])
        at += n_groups * 16 + 8 * n_masks
    low = _unpack(torch.cat(nibble_parts, dim=1), 4, k).view(torch.uint8)  # [R, K] in [0, 15]
    t = _chunk_transpose(low, inverse=False)
    for (lo, n_groups), masks in zip(_chunks(k), mask_parts):
        bits = (masks.reshape(r, -1, 8, 1) >> torch.arange(8, dtype=torch.uint8)) & 1  # [R, vectors, 8, 8]
        fifth = bits.reshape(r, -1, 64) << 4
        vectors = _value_vectors(t, k, lo, n_groups) | fifth  # the padding lanes' bits are zero
        if n_groups == 16:
            t[:, lo : lo + 16 * GROUP] = vectors.reshape(r, -1)
        elif _compact_tail(k):
            t[:, lo : lo + n_groups * GROUP] = vectors.reshape(r, -1)[:, : n_groups * GROUP]
        else:
            t[:, lo : lo + n_groups * GROUP] = vectors[:, :, : n_groups * 4].reshape(r, -1)
    return (_chunk_transpose(t, inverse=True).to(torch.int16) - 16).to(torch.int8)


def _masks_of(n_groups: int, k: int) -> int:
    """Fifth-bit masks (value vectors) of a bits-5 chunk (masks_of in csrc/qlinear.cpp)."""
    if n_groups == 16 or not _compact_tail(k):
        return 8
    return 1 if n_groups < 4 else n_groups // 2


def padded_rows(n: int, width: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Zeroed uint8 rows [n, width] whose storage has READ_PAD bytes after the last row: the
    kernel's plain 64-byte loads of a short last chunk read past the row (those lanes meet zero
    activations)."""
    flat = torch.zeros(n * width + READ_PAD, dtype=torch.uint8, device=device)
    return flat[: n * width].view(n, width)


def _padded(packed: torch.Tensor) -> torch.Tensor:
    """A copy of packed rows in `padded_rows`."""
    out = padded_rows(packed.shape[0], packed.shape[1], packed.device)
    out.copy_(packed)
    return out


# Rows packed per pass by `pack_rows`: the packing's temporaries (several copies of the rows it
# works on) stay a few MB instead of several times a whole matrix's bytes (the bundled Gemma's
# 262,144 x 640 table: +820 MB at load when packed at once).
ROWS_PER_PASS = 4096


def pack_rows(q: torch.Tensor, bits: int) -> torch.Tensor:
    """`_padded(_pack(q, bits))` made ROWS_PER_PASS rows at a time (the packing is row-local)."""
    n = q.shape[0]
    first = _pack(q[:ROWS_PER_PASS], bits)
    if n <= ROWS_PER_PASS:
        return _padded(first)
    out = padded_rows(n, first.shape[1], q.device)
    out[:ROWS_PER_PASS] = first
    del first
    for start in range(ROWS_PER_PASS, n, ROWS_PER_PASS):
        out[start : start + ROWS_PER_PASS] = _pack(q[start : start + ROWS_PER_PASS], bits)
    return out


def _chunks(k: int) -> list[tuple[int, int]]:
    """(first value, groups) of each chunk of 16 groups of a K-long row."""
    g = k // GROUP
    return [(c * GROUP, min(16, g - c)) for c in range(0, g, 16)]


def _unpack(p: torch.Tensor, bits: int, k: int) -> torch.Tensor:
    """Inverse of _pack: the kernel's rows [R, K, K / 2 or ~5 K / 8] -> int8 [R, K]."""
    if bits == 8:
        return (_chunk_transpose(p, inverse=True) ^ 128).view(torch.int8)
    if bits == 5:
        return _unpack5(p, k)
    r = p.shape[0]
    out = []
    for lo, n_groups in _chunks(k):
        packed = p[:, lo // 2 : lo // 2 + n_groups * 16]
        if n_groups < 16 and _compact_tail(k):
            block = min(128, n_groups * GROUP)
            packed = packed.reshape(r, -1, 1, block // 2)  # [R, blocks, 1, B / 2]
        else:
            packed = packed.reshape(r, 4, 1, n_groups * 4)  # [R, u, 1, bytes]
        out.append(torch.cat([packed & 15, packed >> 4], dim=2).reshape(r, -1))
    return _chunk_transpose(torch.cat(out, dim=1), inverse=True).view(torch.int8)


# The names other ops modules use.
chunk_transpose = _chunk_transpose
pack_words = _pack
unpack_words = _unpack
