"""Super-block (GGUF Q4_K / Q6_K) weights in the layout of the `sbmm` kernel, and the stack of
differently quantized row blocks a fused projection may be.

Owns `PackedSuperBlock` (the packing of a `SuperBlockWeight` for csrc/qlinear.cpp's `sbmm` —
straight from the file's blocks by csrc/repack.cpp when the weight is still `RawSuperBlocks`,
else from its integers in plain torch, byte for byte the same — its exact inverse for embedding
rows and dequantization, and the call) and `PackedStack` (one packed weight per row block,
outputs side by side). The format math is quantized.py's; the choice of
which packed class a weight becomes is qlinear.py's `pack`.

Layout (the contract with `sbmm`; csrc/qlinear.cpp says it in full): a row is padded with zero
weights to whole chunks of 512 (C chunks) and held as two uint8 arrays,
- q4_k: `values` [N, C * 256], each chunk the bits-4 layout of qlinear.py's `_pack`; `meta`
  [N, C * 40]: sc[16] | m[16] | d, d, dmin, dmin (float16, one per super-block of the chunk);
- q6_k: `values` [N, C * 384], each chunk the bits-4 bytes of the low nibbles of u = q + 32 (256
  bytes), then two vectors of high bit pairs (byte i of vector h holds bits 4-5 of value vector
  4 h + k at bits 2 k, 2 k + 1); `meta` [N, C * 40]: the scales of each group's first 16 weights
  (int8[16]), of its last 16 (int8[16]), d, d (float16), 4 unused bytes.
A row whose K leaves a last half chunk (K % 512 == 256: the experts' down projection at 768) holds
that chunk in half the bytes: the first 32 bytes of each of its 64-byte vectors, the bytes of
groups 0-7 (`_halve_tail`; the kernel reads them as 256-bit loads); its meta stays 40 bytes.
Bytes per weight: q4_k 0.578 (the file's 0.5625), q6_k 0.828 (the file's 0.820).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from freetoken.ops.quantized import GROUP, SUPER, RawSuperBlocks, SuperBlockWeight, dequantize
from freetoken.ops.layout import chunk_transpose, pack_words, unpack_words

try:  # built by `pip install -e .` (setup.py); without it, packing goes through the integers
    from freetoken.ops import _repack_cpu as _REPACK
except ImportError:
    _REPACK = None

CHUNK = 512  # weights per chunk: 16 groups of 32, two super-blocks
META = 40  # meta bytes per chunk
_KIND_CODE = {"q4_k": 4, "q6_k": 6}
_CHUNK_BYTES = {"q4_k": 256, "q6_k": 384}


def _per_chunk(t: torch.Tensor, chunks: int, width: int) -> torch.Tensor:
    """[N, chunks * width - pad] -> [N, chunks, width], zero-padded (groups past K)."""
    n = t.shape[0]
    return F.pad(t, (0, chunks * width - t.shape[1])).reshape(n, chunks, width)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """[..., k] of any dtype -> [..., k * itemsize] uint8."""
    return t.contiguous().view(torch.uint8)


def pack_values(w: SuperBlockWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, meta) uint8 arrays of `w` in the kernel's layout (module docstring): natively
    from the blocks of a `RawSuperBlocks` not yet decoded (csrc/repack.cpp, both cores, no
    per-weight intermediates), else from the integers."""
    if _REPACK is not None and isinstance(w, RawSuperBlocks) and w._ints is None:
        return _REPACK.repack_superblocks([b.contiguous() for b in w.parts], _KIND_CODE[w.kind], w.k)
    n, k = w.shape
    chunks = -(-k // CHUNK)
    kp = chunks * CHUNK
    if w.kind == "q4_k":
        values = pack_words(F.pad(w.q, (0, kp - k)), 4)  # [N, C * 256]
        sc, m = _per_chunk(w.sc, chunks, 16), _per_chunk(w.m, chunks, 16)
        d, dmin = _per_chunk(w.d, chunks, 2), _per_chunk(w.dmin, chunks, 2)
        meta = torch.cat([sc, m, _bytes(d), _bytes(dmin)], dim=2)
    else:
        u = F.pad((w.q + 32).view(torch.uint8), (0, kp - k))  # [N, Kp] in [0, 63]
        low = pack_words((u & 15).view(torch.int8), 4).reshape(n, chunks, 256)
        vectors = chunk_transpose(u, inverse=False).reshape(n, chunks, 2, 4, 64)  # [N, C, h, k, byte]
        pairs = (vectors >> 4) << torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(1, 1, 1, 4, 1)
        high = pairs.sum(dim=3, dtype=torch.uint8).reshape(n, chunks, 128)  # disjoint bits: sum == or
        values = torch.cat([low, high], dim=2).reshape(n, chunks * 384)
        sc = w.sc.view(torch.uint8)
        first, last = _per_chunk(sc[:, 0::2], chunks, 16), _per_chunk(sc[:, 1::2], chunks, 16)
        d = _per_chunk(w.d, chunks, 2)
        meta = torch.cat([first, last, _bytes(d), d.new_zeros(n, chunks, 4, dtype=torch.uint8)], dim=2)
    return _halve_tail(values, k, w.kind).contiguous(), meta.reshape(n, chunks * META).contiguous()


def half_tail(k: int) -> bool:
    """Whether a K-long row ends in a half chunk (one super-block of the last chunk's two)."""
    return k % CHUNK == SUPER


def _halve_tail(values: torch.Tensor, k: int, kind: str) -> torch.Tensor:
    """[N, C * CB] -> [N, C * CB - CB / 2] where K leaves a half chunk: of the last chunk's 64-byte
    vectors only the first 32 bytes (groups 0-7) are kept; other rows as they are."""
    if not half_tail(k):
        return values
    n, cb = values.shape[0], _CHUNK_BYTES[kind]
    tail = values[:, -cb:].reshape(n, cb // 64, 64)[:, :, :32].reshape(n, cb // 2)
    return torch.cat([values[:, :-cb], tail], dim=1)


def _whole_tail(values: torch.Tensor, k: int, kind: str) -> torch.Tensor:
    """The inverse of `_halve_tail`: the half chunk's vectors zero-filled back to 64 bytes."""
    if not half_tail(k):
        return values
    n, cb = values.shape[0], _CHUNK_BYTES[kind]
    tail = F.pad(values[:, -(cb // 2) :].reshape(n, cb // 64, 32), (0, 32)).reshape(n, cb)
    return torch.cat([values[:, : -(cb // 2)], tail], dim=1)


def unpack_values(kind: str, values: torch.Tensor, meta: torch.Tensor, k: int) -> SuperBlockWeight:
    """The exact inverse of `pack_values` for the rows given ([R, ...] -> a SuperBlockWeight [R, K])."""
    r = values.shape[0]
    chunks = -(-k // CHUNK)
    kp = chunks * CHUNK
    meta = meta.reshape(r, chunks, META)
    values = _whole_tail(values, k, kind)

    def halves(t: torch.Tensor) -> torch.Tensor:  # [R, C, 2] float16 -> [R, K // 256]
        return t.reshape(r, chunks * 2)[:, : k // SUPER].contiguous()

    def groups(t: torch.Tensor) -> torch.Tensor:  # [R, C, 16] -> [R, K // 32]
        return t.reshape(r, chunks * 16)[:, : k // GROUP].contiguous()

    if kind == "q4_k":
        q = unpack_words(values, 4, kp)[:, :k].contiguous()
        d, dmin = meta[:, :, 32:36].contiguous().view(torch.float16), meta[:, :, 36:40].contiguous().view(torch.float16)
        return SuperBlockWeight("q4_k", q, groups(meta[:, :, :16]), halves(d), groups(meta[:, :, 16:32]), halves(dmin))
    body = values.reshape(r, chunks, 384)
    low = unpack_words(body[:, :, :256].reshape(r, chunks * 256), 4, kp).view(torch.uint8)  # [R, Kp]
    vectors = chunk_transpose(low, inverse=False).reshape(r, chunks, 2, 4, 64)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(1, 1, 1, 4, 1)
    high = ((body[:, :, 256:].reshape(r, chunks, 2, 1, 64) >> shifts) & 3) << 4
    u = chunk_transpose((vectors | high).reshape(r, kp), inverse=True)[:, :k]
    q = (u.to(torch.int16) - 32).to(torch.int8).contiguous()
    sc = torch.stack([groups(meta[:, :, :16]), groups(meta[:, :, 16:32])], dim=2).reshape(r, k // 16)
    d = meta[:, :, 32:36].contiguous().view(torch.float16)
    return SuperBlockWeight("q6_k", q, sc.view(torch.int8).contiguous(), halves(d))


class PackedSuperBlock:
    """A SuperBlockWeight [N, K] in the `sbmm` kernel's layout, built once at load (CPU only; a
    weight with no kernel to run it is packed by qlinear.pack in the group-32 form instead)."""

    def __init__(self, w: SuperBlockWeight, kernel: object) -> None:
        self.out_features, self.in_features = w.shape
        self.kind, self.bits = w.kind, w.bits
        self.values, self.meta = pack_values(w)
        if isinstance(w, RawSuperBlocks) and w.release is not None:
            w.release(w.parts)  # read once: the file's pages need not stay counted as resident
        self._kernel_module = kernel
        self._code = _KIND_CODE[w.kind]
        # qlinear's two paths, as plain functions of (self, x, bias) like PackedWeight's: the
        # kernel takes every row count.
        self._small = self._large = PackedSuperBlock._matmul

    def state(self) -> dict:
        """Plain values (qlinear.packed_state): `from_state` rebuilds the weight from them."""
        return {
            "form": "superblock",
            "kind": self.kind,
            "shape": [self.out_features, self.in_features],
            "values": self.values,
            "meta": self.meta,
        }

    @staticmethod
    def from_state(state: dict, kernel: object) -> PackedSuperBlock:
        self = PackedSuperBlock.__new__(PackedSuperBlock)
        self.out_features, self.in_features = state["shape"]
        self.kind = state["kind"]
        self.bits = 4 if self.kind == "q4_k" else 6
        self.values, self.meta = state["values"], state["meta"]
        self._kernel_module, self._code = kernel, _KIND_CODE[self.kind]
        self._small = self._large = PackedSuperBlock._matmul
        return self

    @property
    def nbytes(self) -> int:
        return self.values.numel() + self.meta.numel()

    @property
    def format(self) -> str:
        return self.kind

    def __repr__(self) -> str:
        return f"PackedSuperBlock({self.out_features}x{self.in_features}, {self.kind})"

    def weight_rows(self, start: int, stop: int) -> SuperBlockWeight:
        return unpack_values(self.kind, self.values[start:stop], self.meta[start:stop], self.in_features)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """Rows `ids` of the dequantized weight (an embedding lookup): ids.shape + [K], in `dtype`."""
        flat = ids.reshape(-1)
        w = self._dequantized(self.values.index_select(0, flat), self.meta.index_select(0, flat), dtype)
        return w.reshape(*ids.shape, self.in_features)

    def rows_range(self, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
        return self._dequantized(self.values[start:stop], self.meta[start:stop], dtype)

    def _dequantized(self, values: torch.Tensor, meta: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Packed rows -> [R, K] in `dtype`, as quantized.dequantize computes them (natively, bit
        for bit the same, when the extension is built)."""
        if _REPACK is None:
            return dequantize(unpack_values(self.kind, values, meta, self.in_features), dtype)
        bf16 = dtype == torch.bfloat16
        w = _REPACK.dequantize_superblocks(values.contiguous(), meta.contiguous(), self._code, self.in_features, bf16)
        return w if bf16 else w.to(dtype)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.rows_range(0, self.out_features, dtype)

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self._kernel_module.sbmm(x, self.values, self.meta, bias, self._code)  # type: ignore[attr-defined]


def grouped_matmul(x: torch.Tensor, offsets: torch.Tensor, weights: list[PackedSuperBlock]) -> torch.Tensor:
    """Rows [offsets[a], offsets[a + 1]) of x [P, K] times weights[a]^T -> [P, N] in x's dtype:
    every weight one kind and shape [N, K] (a mixture of experts' step, one call for all)."""
    w = weights[0]
    return w._kernel_module.grouped_sbmm(  # type: ignore[attr-defined]
        x, offsets, [m.values for m in weights], [m.meta for m in weights], w._code, w.out_features
    )


class PackedStack:
    """Row blocks packed each in its own form (a fused projection over parts of different GGUF
    types); y is the blocks' outputs side by side."""

    def __init__(self, parts: list) -> None:
        self.parts = parts
        self.out_features = sum(p.out_features for p in parts)
        self.in_features = parts[0].in_features
        self.bits = max(p.bits for p in parts)
        self._small, self._large = PackedStack._small_rows, PackedStack._large_rows

    def state(self) -> dict:
        return {"form": "stack", "parts": [p.state() for p in self.parts]}

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    @property
    def format(self) -> str:
        return " + ".join(p.format for p in self.parts)

    def __repr__(self) -> str:
        return f"PackedStack({self.out_features}x{self.in_features}: {self.format})"

    def rows_range(self, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
        out, at = [], 0
        for p in self.parts:
            lo, hi = max(start, at), min(stop, at + p.out_features)
            if lo < hi:
                out.append(p.rows_range(lo - at, hi - at, dtype))
            at += p.out_features
        return torch.cat(out)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        raise ValueError("a stacked projection is never an embedding table")

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.rows_range(0, self.out_features, dtype)

    def _small_rows(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = torch.cat([p._small(p, x, None) for p in self.parts], dim=-1)
        return y + bias if bias is not None else y

    def _large_rows(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = torch.cat([p._large(p, x, None) for p in self.parts], dim=-1)
        return y + bias if bias is not None else y


class PackedColumns:
    """A packed matrix whose stored columns are the inputs in another order (ColumnOrderedWeight):
    y = x[:, order] @ stored^T. The gather costs one [M, K] copy of the activations; the weight
    is read as the file stores it."""

    def __init__(self, inner: object, order: torch.Tensor) -> None:
        self.inner, self.order = inner, order  # order int64 [K]: stored column c is input order[c]
        self.out_features, self.in_features = inner.out_features, inner.in_features  # type: ignore[attr-defined]
        self.bits = inner.bits  # type: ignore[attr-defined]
        self._small, self._large = PackedColumns._small_rows, PackedColumns._large_rows

    def state(self) -> dict:
        return {"form": "columns", "order": self.order, "inner": self.inner.state()}  # type: ignore[attr-defined]

    @property
    def nbytes(self) -> int:
        return self.inner.nbytes + self.order.numel() * self.order.element_size()  # type: ignore[attr-defined]

    @property
    def format(self) -> str:
        return self.inner.format  # type: ignore[attr-defined]

    def __repr__(self) -> str:
        return f"PackedColumns({self.inner!r}, columns reordered)"

    def rows_range(self, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
        stored = self.inner.rows_range(start, stop, dtype)  # type: ignore[attr-defined]
        w = torch.empty_like(stored)
        w[:, self.order] = stored
        return w

    def rows(self, ids: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        raise ValueError("a matrix with reordered columns is never an embedding table")

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.rows_range(0, self.out_features, dtype)

    def _small_rows(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self.inner._small(self.inner, x.index_select(-1, self.order), bias)  # type: ignore[attr-defined]

    def _large_rows(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self.inner._large(self.inner, x.index_select(-1, self.order), bias)  # type: ignore[attr-defined]
