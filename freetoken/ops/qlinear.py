"""Weight-only quantized linear layers: `PackedWeight` (a QuantizedWeight laid out once, at load,
for the kernel that will read it) and `qlinear` (y = x @ W^T + b, dispatched by row count).

Owns the packed layout and the choice of path; the kernel itself lives in csrc/qlinear.cpp and the
format math in quantized.py. The path for each row count is bound once, when the weight is packed,
so a call costs one Python branch and one op: no feature checks and no allocations besides the
output. It must not keep a bfloat16 copy of a weight between calls. An 8-bit weight whose integers fit in
[-16, 15] (GGUF Q5_0) is packed as 5 bits when the kernel takes them (5/8 of the bytes).

Paths (CPU): M < PREFILL_ROWS -> the kernel when it was built and the CPU has the features
(AVX-512 VNNI, or AVX2 + FMA + F16C: csrc/group32_avx2.h); otherwise torch's `_weight_int4pack_mm_for_cpu` for 4-bit weights with bfloat16
activations, or dequantize + F.linear. M >= PREFILL_ROWS -> the kernel as well (it beats
dequantize-in-tiles + bf16 GEMM at the shapes measured; see docs/engineering/kernels.md). CUDA: the
Triton kernel (ops/triton_qlinear.py, its own row layout) for every row count where triton imports.
Other devices: dequantize + F.linear.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from types import ModuleType

import torch
import torch.nn.functional as F

from freetoken.ops.layout import ROWS_PER_PASS, _chunk_transpose, _pack, _unpack, pack_rows, padded_rows
from freetoken.ops.quantized import (
    GROUP,
    ColumnOrderedWeight,
    Quantized,
    QuantizedWeight,
    RawGroupBlocks,
    StackedWeight,
    SuperBlockWeight,
    still_in_blocks,
)
from freetoken.ops.superblock import _REPACK, PackedColumns, PackedStack, PackedSuperBlock  # _REPACK: csrc/repack.cpp

log = logging.getLogger(__name__)

# Rows of output computed per dequantized tile on the large-M fallback (bf16 tile ~ 0.5-1 MB: L2).
TILE_ROWS = 512


def _load_extension() -> ModuleType | None:
    try:
        from freetoken.ops import _qlinear_cpu  # built by `pip install -e .` (setup.py)
    except ImportError as err:
        log.info("freetoken.ops: C++ qlinear kernel not built (%s); using torch fallback", err)
        return None
    return _qlinear_cpu


def _load_kernel(ext: ModuleType | None) -> ModuleType | None:
    """The extension where this CPU runs its group-32 kernel (qmm): AVX-512 VNNI, or AVX2 + FMA +
    F16C (csrc/group32_avx2.h; an older build without it needs AVX-512)."""
    if ext is None:
        return None
    supported = getattr(ext, "group32_supported", ext.supported)
    if not supported():
        log.info("freetoken.ops: CPU lacks AVX2 / FMA / F16C; group-32 weights use the torch fallback")
        return None
    return ext


def _load_superblock_kernel(ext: ModuleType | None) -> ModuleType | None:
    """The extension where this CPU runs its super-block (Q4_K / Q6_K) kernel in superblock.py's
    layout (2: half last chunks; an older build pads them and is not used for these): AVX-512
    VNNI, or AVX2 + FMA + F16C (csrc/superblock_avx2.h)."""
    if ext is None or 6 not in getattr(ext, "superblock_kinds", ()) or getattr(ext, "superblock_layout", 1) != 2:
        return None
    supported = getattr(ext, "superblock_supported", ext.supported)
    if not supported():
        log.info("freetoken.ops: CPU lacks AVX2 / FMA / F16C; Q4_K / Q6_K weights use the torch fallback")
        return None
    return ext


_EXTENSION = _load_extension()
_KERNEL: ModuleType | None = _load_kernel(_EXTENSION)  # decided once at import; never reassigned
# Whether the kernel takes 5-bit weights (an older build of the extension does not).
_FIVE_BITS = _KERNEL is not None and 5 in getattr(_KERNEL, "bits", ())
# The super-block kernel (sbmm), which also runs on CPUs with AVX2 but no AVX-512.
_SB_KERNEL: ModuleType | None = _load_superblock_kernel(_EXTENSION)
_SUPERBLOCKS = _SB_KERNEL is not None


def grouped_matmul_available() -> bool:
    """Whether `superblock.grouped_matmul` can run (the kernel built, with `grouped_sbmm`)."""
    return _SUPERBLOCKS and hasattr(_SB_KERNEL, "grouped_sbmm")


def kernel_available() -> bool:
    """Whether CPU qlinear calls of group-32 weights run FreeToken's own kernel (AVX-512 VNNI or AVX2)."""
    return _KERNEL is not None


def superblock_kernel_available() -> bool:
    """Whether Q4_K / Q6_K weights run FreeToken's super-block kernel (AVX-512 VNNI or AVX2)."""
    return _SUPERBLOCKS


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
        # The kernel's layout on every device (layout.py _pack): vpdpbusd takes unsigned weights.
        self.packed = pack_rows(qw.q, self.bits)
        self.scale = qw.scale.contiguous()
        self.minimum = qw.minimum.contiguous() if qw.minimum is not None else None
        # Only without the kernel, for 4-bit on CPU: torch's int4 layout, beside ours (rows() reads ours).
        self.int4pack: tuple[torch.Tensor, torch.Tensor] | None = None
        if (
            qw.q.device.type == "cpu"
            and _KERNEL is None
            and qw.bits == 4
            and n % 16 == 0
            and hasattr(torch, "_convert_weight_to_int4pack_for_cpu")
        ):
            self.int4pack = self._torch_int4pack(qw)
        self._bind_paths()

    def _bind_paths(self) -> None:
        """Choose the matmul path for each row count from the device and the kernel."""
        self._order: torch.Tensor | None = None  # see _natural_order
        # The paths as plain functions of (self, x, bias), not bound methods: a bound method kept
        # on self is a reference cycle, and an evicted expert would wait for the garbage collector.
        self._small: _Path
        self._large: _Path
        if self.packed.device.type != "cpu":
            self._small = self._large = PackedWeight._dequantized_linear
        elif _KERNEL is not None:
            self._small = self._large = PackedWeight._kernel
        else:
            self._small, self._large = PackedWeight._dequantized_linear, PackedWeight._tiled_linear
            if self.int4pack is not None:
                self._small = PackedWeight._int4pack_or_dequantized

    @staticmethod
    def from_quantized(qw: QuantizedWeight) -> PackedWeight:
        return PackedWeight(qw)

    @staticmethod
    def from_blocks(w: RawGroupBlocks) -> PackedWeight:
        """`PackedWeight(w)` bit for bit, for a matrix still in its file's blocks (CPU, the
        kernel's layout): Q8_0 moved natively in one pass over the blocks (csrc/repack.cpp: no
        integers decoded, both cores), unless its integers fit 5 bits; every other type (or that
        case) decoded and packed in passes (`in_passes`). Each way the blocks' file pages are
        dropped once packed."""
        if _REPACK is None or w.kind != "Q8_0" or not hasattr(_REPACK, "repack_q8_0"):
            return PackedWeight.in_passes(w)
        packed, scale, fits5 = _REPACK.repack_q8_0([b.contiguous() for b in w.parts], w.k)
        if fits5 and _FIVE_BITS:
            return PackedWeight.in_passes(w)
        if w.release is not None:
            w.release(w.parts)
        return PackedWeight._made(packed, scale, None, 8)

    @staticmethod
    def _made(packed: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor | None, bits: int) -> PackedWeight:
        """A PackedWeight of rows already in the kernel's layout (READ_PAD bytes after them)."""
        self = PackedWeight.__new__(PackedWeight)
        self.out_features, self.bits = packed.shape[0], bits
        self.in_features = scale.shape[1] * GROUP
        self.packed, self.scale, self.minimum, self.int4pack = packed, scale, minimum, None
        self._bind_paths()
        return self

    @staticmethod
    def in_passes(w: RawGroupBlocks) -> PackedWeight:
        """`PackedWeight(w)` bit for bit, for a matrix still in its file's blocks (CPU, the
        kernel's layout), decoded and packed ROWS_PER_PASS rows at a time, each pass's file pages
        dropped once packed: the load holds one pass's integers, not the whole matrix's plus its
        file pages (the bundled Gemma's 262,144-row table: +515 MB at load packed at once, +195
        MB in passes, its own packed bytes).
        Packs at the width of the first pass and starts over at 8 bits in the rare case a later
        pass's integers do not fit 5."""
        n, k = w.shape
        first = w.rows(0, ROWS_PER_PASS)  # decoded once: for the width, then packed
        bits = _packed_bits(first)
        while True:
            scale = torch.empty(n, k // GROUP, dtype=torch.float16)
            minimum: torch.Tensor | None = None
            packed: torch.Tensor | None = None
            for start in range(0, n, ROWS_PER_PASS):
                part = first if start == 0 else w.rows(start, start + ROWS_PER_PASS)
                if bits == 5 and _packed_bits(part) != 5:
                    break
                rows = _pack(part.q, bits)
                packed = padded_rows(n, rows.shape[1]) if packed is None else packed
                packed[start : start + rows.shape[0]] = rows
                scale[start : start + rows.shape[0]] = part.scale
                if part.minimum is not None:
                    minimum = torch.empty_like(scale) if minimum is None else minimum
                    minimum[start : start + rows.shape[0]] = part.minimum
                if w.release is not None:
                    w.release(part.parts)
            else:
                break
            bits = 8
        return PackedWeight._made(packed, scale, minimum, bits)

    def state(self) -> dict:
        """The packed form as plain values (tensors, numbers, strings): `from_state` rebuilds it
        without recomputing anything (the weight cache, models/snapshot.py)."""
        return {
            "form": "group32",
            "shape": [self.out_features, self.in_features],
            "bits": self.bits,
            "packed": self.packed,
            "scale": self.scale,
            "minimum": self.minimum,
            "int4pack": list(self.int4pack) if self.int4pack is not None else None,
        }

    @staticmethod
    def from_state(state: dict) -> PackedWeight:
        self = PackedWeight.__new__(PackedWeight)
        self.out_features, self.in_features = state["shape"]
        self.bits, self.packed, self.scale, self.minimum = (
            state["bits"],
            state["packed"],
            state["scale"],
            state["minimum"],
        )
        self.int4pack = tuple(state["int4pack"]) if state["int4pack"] is not None else None  # type: ignore[assignment]
        self._bind_paths()
        return self

    @property
    def format(self) -> str:
        """What the weight runs as (`ft inspect`, the start-up plan)."""
        return f"int{self.bits}"

    @property
    def nbytes(self) -> int:
        tensors = [self.packed, self.scale, self.minimum, *(self.int4pack or ())]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def __repr__(self) -> str:
        kind = "kernel" if self._small is PackedWeight._kernel else "torch"
        return f"PackedWeight({self.out_features}x{self.in_features}, bits={self.bits}, {kind})"

    # --- dequantization (reference, embedding rows, fallbacks) ---------------------------------

    def _rows_of(
        self, packed: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor | None, dtype: torch.dtype
    ) -> torch.Tensor:
        return self._scaled(_unpack(packed, self.bits, self.in_features), scale, minimum, dtype)

    def _scaled(
        self, q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor | None, dtype: torch.dtype
    ) -> torch.Tensor:
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
            self._order = _chunk_transpose(torch.arange(k, device=self.packed.device).view(1, k), inverse=True)[
                0
            ].contiguous()
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


Packed = PackedWeight | PackedSuperBlock | PackedStack | PackedColumns


@functools.cache
def _triton_layout() -> type | None:
    """The Triton kernel's packed weight class (ops/triton_qlinear.py), or None without triton."""
    try:
        from freetoken.ops.triton_qlinear import TritonPackedWeight
    except ImportError:
        return None
    return TritonPackedWeight


def _wants_triton(device: torch.device) -> bool:
    """Whether a weight on `device` runs through the Triton kernel: on CUDA, where triton imports."""
    return device.type == "cuda" and _triton_layout() is not None


def pack(w: Quantized) -> Packed:
    """The packed form `w` runs in: on CUDA the Triton kernel's group-32 layout (where triton
    imports); a super-block weight in its own integers where the kernel takes them (CPU), else in
    the group-32 form; a stack part by part; a column-ordered matrix as stored, its inputs gathered."""
    if isinstance(w, StackedWeight):
        return PackedStack([pack(p) for p in w.parts])
    if isinstance(w, ColumnOrderedWeight):
        return PackedColumns(pack(w.inner), w.order)
    device = w.device
    if _wants_triton(device):
        layout = _triton_layout()
        return layout(w.to_group32() if isinstance(w, SuperBlockWeight) else w)  # type: ignore[misc]
    if isinstance(w, SuperBlockWeight):
        if _SUPERBLOCKS and w.device.type == "cpu":
            return PackedSuperBlock(w, _SB_KERNEL)
        return PackedWeight(w.to_group32())
    if isinstance(w, RawGroupBlocks) and still_in_blocks(w) and _KERNEL is not None:
        return PackedWeight.from_blocks(w)
    return PackedWeight(w)


def from_state(state: dict) -> Packed:
    """The packed weight whose `state()` this is, its tensors taken as they are (no copy, no
    repacking). Raises ValueError for a form this build cannot run (a super-block weight without
    the kernel): the caller's cache was made elsewhere."""
    form = state["form"]
    if form == "group32":
        return PackedWeight.from_state(state)
    if form == "stack":
        return PackedStack([from_state(p) for p in state["parts"]])
    if form == "columns":
        return PackedColumns(from_state(state["inner"]), state["order"])
    if form == "superblock" and _SUPERBLOCKS:
        return PackedSuperBlock.from_state(state, _SB_KERNEL)
    if form == "triton_group32" and _triton_layout() is not None:
        return _triton_layout().from_state(state)  # type: ignore[union-attr]
    raise ValueError(f"packed form {form!r} cannot run in this build")


def runs_on_torch(p: Packed) -> bool:
    """Whether `p`'s CPU calls take torch's fallback: a group-32 part where the group-32 kernel
    does not run (no AVX-512 VNNI), which dequantizes on every call."""
    if isinstance(p, PackedStack):
        return any(runs_on_torch(q) for q in p.parts)
    if isinstance(p, PackedColumns):
        return runs_on_torch(p.inner)
    return isinstance(p, PackedWeight) and _KERNEL is None and p.packed.device.type == "cpu"


def signature() -> str:
    """What decides the packed forms besides the weights: which kernel paths this build has."""
    return f"kernel={_KERNEL is not None},five_bits={_FIVE_BITS},superblocks={_SUPERBLOCKS}"


def qlinear(x: torch.Tensor, w: Packed, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y[M, N] = x[M, K] @ dequantize(w)^T + bias, in x's dtype (bfloat16 or float32)."""
    if x.shape[0] < PREFILL_ROWS:
        return w._small(w, x, bias)
    return w._large(w, x, bias)
