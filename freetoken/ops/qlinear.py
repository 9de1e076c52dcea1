"""Weight-only quantized linear layers: `PackedWeight` (a QuantizedWeight laid out once, at load,
for the kernel that will read it) and `qlinear` (y = x @ W^T + b, dispatched by row count).

Owns the packed layout and the choice of path; the kernel itself lives in csrc/qlinear.cpp and the
format math in quantized.py. The path for each row count is bound once, when the weight is packed,
so a call costs one Python branch and one op: no feature checks and no allocations besides the
output. It must not keep a bfloat16 copy of a weight between calls. An 8-bit weight whose integers fit in
[-16, 15] (GGUF Q5_0) is packed as 5 bits when the kernel takes them (5/8 of the bytes).

Paths (CPU): M < PREFILL_ROWS -> the AVX-512 VNNI kernel when it was built and the CPU has the
features; otherwise torch's `_weight_int4pack_mm_for_cpu` for 4-bit weights with bfloat16
activations, or dequantize + F.linear. M >= PREFILL_ROWS -> the kernel as well (it beats
dequantize-in-tiles + bf16 GEMM at the shapes measured; see docs/kernels.md). Other devices:
dequantize + F.linear.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from types import ModuleType

import torch
import torch.nn.functional as F

from freetoken.ops.quantized import GROUP, QuantizedWeight

log = logging.getLogger(__name__)

# Bytes the kernel may read past a packed weight's end (kReadPad in csrc/qlinear.cpp).
READ_PAD = 64
# Rows of output computed per dequantized tile on the large-M fallback (bf16 tile ~ 0.5-1 MB: L2).
TILE_ROWS = 512


def _load_kernel() -> ModuleType | None:
    try:
        from freetoken.ops import _qlinear_cpu  # built by `pip install -e .` (setup.py)
    except ImportError as err:
        log.info("freetoken.ops: C++ qlinear kernel not built (%s); using torch fallback", err)
        return None
    if not _qlinear_cpu.supported():
        log.info("freetoken.ops: CPU lacks AVX-512 F/BW/VL/VNNI; using torch fallback for qlinear")
        return None
    return _qlinear_cpu


_KERNEL: ModuleType | None = _load_kernel()  # decided once at import; never reassigned
# Whether the kernel takes 5-bit weights (an older build of the extension does not).
_FIVE_BITS = _KERNEL is not None and 5 in getattr(_KERNEL, "bits", ())


def kernel_available() -> bool:
    """Whether CPU qlinear calls run FreeToken's own kernel."""
    return _KERNEL is not None


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


def _padded(packed: torch.Tensor) -> torch.Tensor:
    """A copy whose storage has READ_PAD bytes after the last row: the kernel's plain 64-byte loads
    of a short last chunk read past the row (those lanes meet zero activations)."""
    flat = torch.zeros(packed.numel() + READ_PAD, dtype=torch.uint8, device=packed.device)
    flat[: packed.numel()] = packed.reshape(-1)
    return flat[: packed.numel()].view(packed.shape)


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


def _packed_bits(qw: QuantizedWeight) -> int:
    """The width the kernel reads `qw` at: an 8-bit weight whose integers all lie in [-16, 15]
    (Q5_0's, kept exactly by the GGUF loader) is read as 5 bits, 5/8 of the bytes."""
    if qw.bits == 8 and _FIVE_BITS and qw.q.device.type == "cpu":
        lo, hi = torch.aminmax(qw.q)
        if lo >= -16 and hi <= 15:
            return 5
    return qw.bits


_Path = Callable[["PackedWeight", torch.Tensor, "torch.Tensor | None"], torch.Tensor]


class PackedWeight:
    """A quantized [N, K] weight in the layout its matmul path reads, built once at load."""

    def __init__(self, qw: QuantizedWeight) -> None:
        n, k = qw.q.shape
        self.out_features, self.in_features, self.bits = n, k, _packed_bits(qw)
        # The kernel's layout on every device (see _pack): vpdpbusd takes unsigned weights.
        self.packed = _padded(_pack(qw.q, self.bits))
        self.scale = qw.scale.contiguous()
        self.minimum = qw.minimum.contiguous() if qw.minimum is not None else None
        # Only without the kernel, for 4-bit on CPU: torch's int4 layout, beside ours (rows() reads ours).
        self.int4pack: tuple[torch.Tensor, torch.Tensor] | None = None
        self._order: torch.Tensor | None = None  # see _natural_order
        # The paths as plain functions of (self, x, bias), not bound methods: a bound method kept
        # on self is a reference cycle, and an evicted expert would wait for the garbage collector.
        self._small: _Path
        self._large: _Path
        if qw.q.device.type != "cpu":
            self._small = self._large = PackedWeight._dequantized_linear
        elif _KERNEL is not None:
            self._small = self._large = PackedWeight._kernel
        else:
            self._small, self._large = PackedWeight._dequantized_linear, PackedWeight._tiled_linear
            if qw.bits == 4 and n % 16 == 0 and hasattr(torch, "_convert_weight_to_int4pack_for_cpu"):
                self.int4pack = self._torch_int4pack(qw)
                self._small = PackedWeight._int4pack_or_dequantized

    @staticmethod
    def from_quantized(qw: QuantizedWeight) -> PackedWeight:
        return PackedWeight(qw)

    @property
    def nbytes(self) -> int:
        tensors = [self.packed, self.scale, self.minimum, *(self.int4pack or ())]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def __repr__(self) -> str:
        kind = "kernel" if self._small is PackedWeight._kernel else "torch"
        return f"PackedWeight({self.out_features}x{self.in_features}, bits={self.bits}, {kind})"

    # --- dequantization (reference, embedding rows, fallbacks) ---------------------------------

    def _rows_of(self, packed: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor | None,
                 dtype: torch.dtype) -> torch.Tensor:
        return self._scaled(_unpack(packed, self.bits, self.in_features), scale, minimum, dtype)

    def _scaled(self, q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        """Integers q [R, K] (int8, or their exact float32 values) with their groups' scale and
        minimum [R, K / 32] -> the weight rows [R, K] in `dtype`."""
        r, k = q.shape
        w = q.float().reshape(r, k // GROUP, GROUP) * scale.float().unsqueeze(2)  # [R, G, 32]
        if minimum is not None:
            w = w + minimum.float().unsqueeze(2)
        return w.reshape(r, k).to(dtype)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """Rows `ids` of the dequantized weight (an embedding lookup): ids.shape + [K], in `dtype`."""
        flat = ids if ids.dim() == 1 else ids.reshape(-1)
        packed, scale = self.packed.index_select(0, flat), self.scale.index_select(0, flat)
        m = self.minimum.index_select(0, flat) if self.minimum is not None else None
        if self.bits == 8:  # once per step (the embedding): one gather undoes the kernel's byte order
            q = packed.index_select(1, self._natural_order()).float() - 128  # [R, K], the int8 values
            out = self._scaled(q, scale, m, dtype)
        else:
            out = self._rows_of(packed, scale, m, dtype)
        return out if ids.dim() == 1 else out.reshape(*ids.shape, self.in_features)

    def _natural_order(self) -> torch.Tensor:
        """int64 [K]: the byte of a packed 8-bit row holding each weight, in the row's order
        (`_chunk_transpose` inverted, as an index; made at the first lookup)."""
        if self._order is None:
            k = self.in_features
            self._order = _chunk_transpose(torch.arange(k, device=self.packed.device).view(1, k), inverse=True)[0].contiguous()
        return self._order

    def rows_range(self, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
        m = self.minimum[start:stop] if self.minimum is not None else None
        return self._rows_of(self.packed[start:stop], self.scale[start:stop], m, dtype)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.rows_range(0, self.out_features, dtype)

    # --- matmul paths ---------------------------------------------------------------------------

    def _kernel(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return _KERNEL.qmm(x, self.packed, self.scale, self.minimum, bias, self.bits)

    def _dequantized_linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, self.dequantize(x.dtype), bias)

    def _tiled_linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """Dequantize TILE_ROWS output rows at a time: no full bf16 copy, each tile read from L2."""
        out_t = torch.empty(self.out_features, x.shape[0], dtype=x.dtype, device=x.device)  # [N, M]: tiles contiguous
        for n0 in range(0, self.out_features, TILE_ROWS):
            n1 = min(n0 + TILE_ROWS, self.out_features)
            torch.mm(self.rows_range(n0, n1, x.dtype), x.t(), out=out_t[n0:n1])
        out = out_t.t()
        return out + bias if bias is not None else out

    def _torch_int4pack(self, qw: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor]:
        # torch's convention: w = (q - 8) * scale + zero, so zero = minimum + 8 * scale.
        packed = torch._convert_weight_to_int4pack_for_cpu(qw.q.to(torch.int32), 1)
        s = qw.scale.float()
        zero = qw.minimum.float() + 8 * s if qw.minimum is not None else 8 * s
        scales_and_zeros = torch.stack([s.t(), zero.t()], dim=2).to(torch.bfloat16).contiguous()  # [G, N, 2]
        return packed, scales_and_zeros

    def _int4pack_or_dequantized(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.dtype != torch.bfloat16:  # torch's float32 int4 path is scalar: dequantize instead
            return self._dequantized_linear(x, bias)
        packed, scales_and_zeros = self.int4pack
        y = torch._weight_int4pack_mm_for_cpu(x, packed, GROUP, scales_and_zeros)
        return y + bias if bias is not None else y


# Row count from which a call is a prefill (compute-bound) rather than a decode (bandwidth-bound).
PREFILL_ROWS = 64


def qlinear(x: torch.Tensor, w: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y[M, N] = x[M, K] @ dequantize(w)^T + bias, in x's dtype (bfloat16 or float32)."""
    if x.shape[0] < PREFILL_ROWS:
        return w._small(w, x, bias)
    return w._large(w, x, bias)
