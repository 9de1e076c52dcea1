"""The canonical forms of a weight-only quantized matrix: the contract between the weight loaders
and the ops. It owns the math of the forms (quantize, dequantize, slice, concatenate) in plain
torch, on any device; it knows no kernel layout (qlinear.py and superblock.py pack) and no file
format (the GGUF loader converts its block types into these forms).

- `QuantizedWeight`, group 32 with float16 scales:
  w[n, k] = q[n, k] * scale[n, k // GROUP] + (minimum[n, k // GROUP] if minimum is not None else 0)
- `SuperBlockWeight`, a GGUF K-quant in its own integers (its scales are products of a float16 per
  256 weights and a small integer per group, kept apart, so nothing is rounded):
  q4_k: w = d[n, k // 256] * sc[n, k // 32] * q - dmin[n, k // 256] * m[n, k // 32], q in [0, 15];
  q6_k: w = d[n, k // 256] * sc[n, k // 16] * q, q in [-32, 31].
- `RawSuperBlocks`, a `SuperBlockWeight` still in the file's blocks (uint8 [N, K / 256 * block
  bytes]): packing for the kernel reads the blocks once (superblock.py, natively); every other use
  decodes the integers on first touch.
- `RawGroupBlocks`, the same for a `QuantizedWeight` (Q8_0, Q5_0, Q4_0, ... blocks): decoded on
  first touch, which is packing, so a load holds one such matrix decoded at a time.
- `StackedWeight`, row blocks of different forms stacked along N (a fused QKV whose V is Q6_K while
  Q and K are Q4_K keeps each part's own form).
- `ColumnOrderedWeight`, a matrix whose stored columns are the inputs in another order (a GGUF's
  Qwen3.5 `out_proj`): the kernel reads it as stored and x's columns are gathered to match.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

GROUP = 32


@dataclass
class QuantizedWeight:
    bits: int  # 8 or 4
    q: torch.Tensor  # int8 [N, K]; bits=8: any int8 value; bits=4: values in [0, 15]
    scale: torch.Tensor  # float16 [N, K // GROUP]
    minimum: torch.Tensor | None  # float16 [N, K // GROUP], or None (symmetric)

    def __post_init__(self) -> None:
        n, k = self.q.shape
        if self.bits not in (4, 8) or k % GROUP or self.q.dtype != torch.int8:
            raise ValueError(f"QuantizedWeight: bits={self.bits}, q {self.q.dtype} {tuple(self.q.shape)}")
        for t in (self.scale, self.minimum):
            if t is not None and (t.dtype != torch.float16 or tuple(t.shape) != (n, k // GROUP)):
                raise ValueError(f"QuantizedWeight: scale/minimum must be float16 [{n}, {k // GROUP}]")

    @property
    def shape(self) -> tuple[int, int]:
        return (self.q.shape[0], self.q.shape[1])

    @property
    def device(self) -> torch.device:
        return self.q.device

    def map_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> QuantizedWeight:
        """The same weight with `fn` applied to each row-indexed tensor (slice, permute, pad, move)."""
        return QuantizedWeight(
            self.bits, fn(self.q), fn(self.scale), None if self.minimum is None else fn(self.minimum)
        )

    def cols(self, start: int, stop: int) -> QuantizedWeight:
        """Columns [start, stop), both multiples of GROUP."""
        if start % GROUP or stop % GROUP:
            raise ValueError(f"columns [{start}, {stop}) cut a group of {GROUP}")
        g0, g1 = start // GROUP, stop // GROUP
        return QuantizedWeight(
            self.bits,
            self.q[:, start:stop].contiguous(),
            self.scale[:, g0:g1].contiguous(),
            None if self.minimum is None else self.minimum[:, g0:g1].contiguous(),
        )


SUPER = 256  # weights per K-quant super-block
SUPERBLOCK_KINDS = ("q4_k", "q6_k")


@dataclass
class SuperBlockWeight:
    kind: str  # "q4_k" | "q6_k"
    q: torch.Tensor  # int8 [N, K]: q4_k in [0, 15]; q6_k in [-32, 31]
    sc: torch.Tensor  # q4_k: uint8 [N, K // 32] in [0, 63]; q6_k: int8 [N, K // 16]
    d: torch.Tensor  # float16 [N, K // 256]
    m: torch.Tensor | None = None  # q4_k: uint8 [N, K // 32] in [0, 63]
    dmin: torch.Tensor | None = None  # q4_k: float16 [N, K // 256]

    def __post_init__(self) -> None:
        n, k = self.q.shape
        if self.kind not in SUPERBLOCK_KINDS or k % SUPER or self.q.dtype != torch.int8:
            raise ValueError(f"SuperBlockWeight: kind={self.kind}, q {self.q.dtype} {tuple(self.q.shape)}")
        four = self.kind == "q4_k"
        expect = [(self.sc, torch.uint8 if four else torch.int8, k // self.group), (self.d, torch.float16, k // SUPER)]
        if four:
            expect += [(self.m, torch.uint8, k // GROUP), (self.dmin, torch.float16, k // SUPER)]
        elif self.m is not None or self.dmin is not None:
            raise ValueError("SuperBlockWeight: q6_k has no minimum")
        for t, dtype, width in expect:
            if t is None or t.dtype != dtype or tuple(t.shape) != (n, width):
                raise ValueError(f"SuperBlockWeight {self.kind}: a field is not {dtype} [{n}, {width}]")

    @property
    def bits(self) -> int:
        return 4 if self.kind == "q4_k" else 6

    @property
    def group(self) -> int:
        """Weights per sub-block scale."""
        return GROUP if self.kind == "q4_k" else 16

    @property
    def shape(self) -> tuple[int, int]:
        return (self.q.shape[0], self.q.shape[1])

    @property
    def device(self) -> torch.device:
        return self.q.device

    def map_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> SuperBlockWeight:
        """The same weight with `fn` applied to each row-indexed tensor (slice, permute, pad, move)."""
        opt = lambda t: None if t is None else fn(t)  # noqa: E731
        return SuperBlockWeight(self.kind, fn(self.q), fn(self.sc), fn(self.d), opt(self.m), opt(self.dmin))

    def cols(self, start: int, stop: int) -> SuperBlockWeight:
        """Columns [start, stop), both multiples of SUPER."""
        if start % SUPER or stop % SUPER:
            raise ValueError(f"columns [{start}, {stop}) cut a super-block of {SUPER}")

        def part(t: torch.Tensor | None, per: int) -> torch.Tensor | None:
            return None if t is None else t[:, start // per : stop // per].contiguous()

        return SuperBlockWeight(
            self.kind,
            part(self.q, 1),
            part(self.sc, self.group),
            part(self.d, SUPER),
            part(self.m, GROUP),
            part(self.dmin, SUPER),
        )

    def scales(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Each sub-block's scale and minimum as float32 [N, K // group], exactly (a float16 times
        an integer below 2**7 fits float32's mantissa)."""
        per = SUPER // self.group
        scale = self.d.float().repeat_interleave(per, dim=1) * self.sc.float()
        if self.m is None:
            return scale, None
        return scale, -(self.dmin.float().repeat_interleave(per, dim=1) * self.m.float())

    def to_group32(self) -> QuantizedWeight:
        """The group-32 float16 form, for paths without the super-block kernel: q4_k keeps its
        nibbles (scales rounded once to float16); q6_k is requantized per 32 to absmax int8 (at
        most half a step of that grid away)."""
        scale, minimum = self.scales()
        if self.kind == "q4_k":
            return QuantizedWeight(4, self.q, scale.half(), minimum.half())
        return quantize_int8(dequantize(self, torch.float32))


class _InBlocks:
    """What a matrix still in its file's blocks is, whatever the block type (`RawSuperBlocks`,
    `RawGroupBlocks`): `parts`, row blocks each uint8 [rows, K / block * block bytes] (one row of
    blocks per matrix row), stacked in order — views of the file's memory map where the loader
    could (read only, never written), several when a fused projection was concatenated (the
    blocks are not copied to join them). Rows can be sliced, permuted, padded and concatenated in
    this form; the integer fields are decoded once, on first touch, by `decode` (supplied by the
    loader, weights/requant.py, which owns the block formats) and kept. `release` (once packed)
    lets the loader drop the blocks' file pages from the process (a part that is not in a file's
    map, such as a permuted copy, is left alone by it)."""

    kind: str
    k: int
    parts: list[torch.Tensor]
    release: Callable[[list[torch.Tensor]], None] | None
    _decode: Callable[[torch.Tensor, str, int], QuantizedWeight | SuperBlockWeight]
    _ints: QuantizedWeight | SuperBlockWeight | None

    def _with(self, parts: list[torch.Tensor]) -> _InBlocks:
        """The same kind of weight over other row blocks."""
        raise NotImplementedError

    @property
    def blocks(self) -> torch.Tensor:
        """All rows' blocks as one tensor (joined here when there are several parts)."""
        return self.parts[0] if len(self.parts) == 1 else torch.cat(self.parts)

    def decoded(self):  # type: ignore[no-untyped-def]
        """The same weight in its integers (decoded on the first call)."""
        if self._ints is None:
            self._ints = self._decode(self.blocks, self.kind, self.k)
        return self._ints

    @property
    def shape(self) -> tuple[int, int]:
        return (sum(b.shape[0] for b in self.parts), self.k)

    @property
    def device(self) -> torch.device:
        return self.parts[0].device

    def map_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]):  # type: ignore[no-untyped-def]
        if self._ints is not None:
            return self._ints.map_rows(fn)
        blocks = fn(self.blocks)
        if blocks.device.type != "cpu":  # the decoder and the packer are CPU code: decode first
            return self.decoded().map_rows(fn)
        return self._with([blocks])

    def rows(self, start: int, stop: int):  # type: ignore[no-untyped-def]
        """Rows [start, stop) still in their blocks: views of the parts they lie in, not a copy of
        the joined matrix (as `map_rows` makes of a fused one)."""
        views, at = [], 0
        for b in self.parts:
            lo, hi = max(start - at, 0), min(stop - at, b.shape[0])
            if lo < hi:
                views.append(b[lo:hi])
            at += b.shape[0]
        return self._with(views)

    def cols(self, start: int, stop: int):  # type: ignore[no-untyped-def]
        return self.decoded().cols(start, stop)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.kind}, {self.shape[0]}x{self.k})"


def _check_parts(parts: list[torch.Tensor]) -> bool:
    """Whether `parts` are 2-D uint8 row blocks of one width."""
    return bool(parts) and all(
        b.dtype == torch.uint8 and b.dim() == 2 and b.shape[1] == parts[0].shape[1] for b in parts
    )


class RawSuperBlocks(_InBlocks, SuperBlockWeight):
    """A Q4_K / Q6_K matrix [N, K] still in the GGUF's blocks (`_InBlocks`); `qlinear.pack` turns it
    into the kernel's layout straight from the blocks (superblock.py, natively)."""

    def __init__(
        self,
        kind: str,
        parts: list[torch.Tensor],
        k: int,
        decode: Callable[[torch.Tensor, str, int], SuperBlockWeight],
        release: Callable[[list[torch.Tensor]], None] | None = None,
    ) -> None:
        if kind not in SUPERBLOCK_KINDS or k % SUPER or not _check_parts(parts):
            raise ValueError(f"RawSuperBlocks: kind={kind}, K={k}, parts {[(b.dtype, tuple(b.shape)) for b in parts]}")
        self.kind, self.parts, self.k, self._decode, self.release = kind, parts, k, decode, release
        self._ints: SuperBlockWeight | None = None

    def _with(self, parts: list[torch.Tensor]) -> RawSuperBlocks:
        return RawSuperBlocks(self.kind, parts, self.k, self._decode, self.release)  # type: ignore[arg-type]

    q = property(lambda self: self.decoded().q)  # type: ignore[assignment]
    sc = property(lambda self: self.decoded().sc)  # type: ignore[assignment]
    d = property(lambda self: self.decoded().d)  # type: ignore[assignment]
    m = property(lambda self: self.decoded().m)  # type: ignore[assignment]
    dmin = property(lambda self: self.decoded().dmin)  # type: ignore[assignment]


class RawGroupBlocks(_InBlocks, QuantizedWeight):
    """A group-32 matrix [N, K] still in the GGUF's blocks (`_InBlocks`; `kind` the GGML type's
    name: Q8_0, Q5_0, Q4_0, ...), `bits` its group-32 form's. Packing is the first touch of its
    integers (or, for Q8_0, moves the blocks natively without decoding), so a load holds one matrix
    decoded at a time, not every matrix of the file at once (a Q8_0 1.1B's first load peaked 1.8 GB
    above what it kept)."""

    def __init__(
        self,
        bits: int,
        kind: str,
        parts: list[torch.Tensor],
        k: int,
        decode: Callable[[torch.Tensor, str, int], QuantizedWeight],
        release: Callable[[list[torch.Tensor]], None] | None = None,
    ) -> None:
        if bits not in (4, 8) or k % GROUP or not _check_parts(parts):
            raise ValueError(f"RawGroupBlocks: bits={bits}, K={k}, parts {[(b.dtype, tuple(b.shape)) for b in parts]}")
        self.bits, self.kind, self.parts, self.k, self._decode, self.release = bits, kind, parts, k, decode, release
        self._ints: QuantizedWeight | None = None

    def _with(self, parts: list[torch.Tensor]) -> RawGroupBlocks:
        return RawGroupBlocks(self.bits, self.kind, parts, self.k, self._decode, self.release)  # type: ignore[arg-type]

    q = property(lambda self: self.decoded().q)  # type: ignore[assignment]
    scale = property(lambda self: self.decoded().scale)  # type: ignore[assignment]
    minimum = property(lambda self: self.decoded().minimum)  # type: ignore[assignment]


def still_in_blocks(w: object) -> bool:
    """Whether `w` is a matrix still in its file's blocks on the CPU (nothing decoded yet)."""
    return isinstance(w, (RawSuperBlocks, RawGroupBlocks)) and w._ints is None and w.device.type == "cpu"


@dataclass
class StackedWeight:
    parts: list[QuantizedWeight | SuperBlockWeight]  # row blocks in order, same K

    @property
    def shape(self) -> tuple[int, int]:
        return (sum(p.shape[0] for p in self.parts), self.parts[0].shape[1])

    def map_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> StackedWeight:
        raise ValueError("a stacked weight is made after the checkpoint's rows are arranged")


@dataclass
class ColumnOrderedWeight:
    """A matrix [N, K] stored with its columns in another order than the layer's inputs: stored
    column c multiplies input `order[c]`. Qwen3.5's `out_proj` in a GGUF is one (value heads tiled
    across key groups): moving its columns back would cut the super-blocks, so it stays as the
    file has it and the packed form (superblock.PackedColumns) gathers x's columns instead."""

    inner: QuantizedWeight | SuperBlockWeight
    order: torch.Tensor  # int64 [K], a permutation of range(K)

    def __post_init__(self) -> None:
        k = self.inner.shape[1]
        if self.order.dtype != torch.int64 or tuple(self.order.shape) != (k,):
            raise ValueError(
                f"ColumnOrderedWeight: order must be int64 [{k}], got {self.order.dtype} {tuple(self.order.shape)}"
            )

    @property
    def shape(self) -> tuple[int, int]:
        return self.inner.shape

    def map_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> ColumnOrderedWeight:
        """Row operations commute with the column order: applied to the stored matrix."""
        inner = self.inner.map_rows(fn)
        device = inner.device
        return ColumnOrderedWeight(inner, self.order.to(device))


Quantized = QuantizedWeight | SuperBlockWeight | StackedWeight | ColumnOrderedWeight


def is_quantized(w: object) -> bool:
    return isinstance(w, (QuantizedWeight, SuperBlockWeight, StackedWeight, ColumnOrderedWeight))


def _groups(w: torch.Tensor) -> torch.Tensor:
    n, k = w.shape
    if k % GROUP:
        raise ValueError(f"in_features {k} is not a multiple of {GROUP}")
    return w.float().reshape(n, k // GROUP, GROUP)  # [N, G, 32]


def quantize_int8(w: torch.Tensor) -> QuantizedWeight:
    """Symmetric absmax per group (like GGUF Q8_0): q in [-127, 127], scale = absmax / 127.
    |w - dequantize| <= scale / 2 (+ the float16 rounding of the scale, <= 127 * scale * 2**-11)."""
    g = _groups(w)
    scale = (g.abs().amax(dim=2) / 127.0).half()  # [N, G]
    s = scale.float().unsqueeze(2)
    q = torch.where(s > 0, g / s.clamp_min(torch.finfo(torch.float32).tiny), 0.0)
    q = q.round().clamp(-127, 127).to(torch.int8).reshape(w.shape)
    return QuantizedWeight(bits=8, q=q, scale=scale, minimum=None)


def quantize_int4(w: torch.Tensor) -> QuantizedWeight:
    """Asymmetric per group (like GGUF Q4_1): q in [0, 15], minimum = group min, scale = range / 15.
    |w - dequantize| <= scale / 2 (+ the float16 rounding of scale and minimum)."""
    g = _groups(w)
    lo, hi = g.amin(dim=2), g.amax(dim=2)
    scale, minimum = ((hi - lo) / 15.0).half(), lo.half()
    s, m = scale.float().unsqueeze(2), minimum.float().unsqueeze(2)
    q = torch.where(s > 0, (g - m) / s.clamp_min(torch.finfo(torch.float32).tiny), 0.0)
    q = q.round().clamp(0, 15).to(torch.int8).reshape(w.shape)
    return QuantizedWeight(bits=4, q=q, scale=scale, minimum=minimum)


def on_device(qw: Quantized, device: torch.device | str) -> Quantized:
    """`qw` with its tensors on `device`; a weight still in its blocks and already there is
    returned as it is (its parts stay where they lie, not joined by a no-op move)."""
    if isinstance(qw, StackedWeight):
        return StackedWeight([on_device(p, device) for p in qw.parts])  # type: ignore[misc]
    if isinstance(qw, ColumnOrderedWeight):
        return ColumnOrderedWeight(on_device(qw.inner, device), qw.order.to(device))  # type: ignore[arg-type]
    if still_in_blocks(qw) and qw.device == torch.device(device):  # type: ignore[union-attr]
        return qw
    return qw.map_rows(lambda t: t.to(device))


def dequantize(qw: Quantized, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The reference: float32 math, then one rounding to `dtype`. [N, K]."""
    if isinstance(qw, StackedWeight):
        return torch.cat([dequantize(p, torch.float32) for p in qw.parts]).to(dtype)
    if isinstance(qw, ColumnOrderedWeight):
        stored = dequantize(qw.inner, dtype)
        w = torch.empty_like(stored)
        w[:, qw.order] = stored  # stored column c is input order[c]
        return w
    if isinstance(qw, SuperBlockWeight):
        n, k = qw.shape
        scale, minimum = qw.scales()  # [N, K / group]
        w = qw.q.float().reshape(n, -1, qw.group) * scale.unsqueeze(2)  # [N, K / group, group]
        if minimum is not None:
            w = w + minimum.unsqueeze(2)
        return w.reshape(n, k).to(dtype)
    n, k = qw.q.shape
    w = qw.q.float().reshape(n, k // GROUP, GROUP) * qw.scale.float().unsqueeze(2)  # [N, G, 32]
    if qw.minimum is not None:
        w = w + qw.minimum.float().unsqueeze(2)
    return w.reshape(n, k).to(dtype)


def _form(p: QuantizedWeight | SuperBlockWeight) -> str:
    return p.kind if isinstance(p, SuperBlockWeight) else "group32"


def concat(parts: list[Quantized]) -> Quantized:
    """Stack along N (fused QKV, gate/up). Super-block parts of one kind stay one super-block
    weight; group-32 parts stay group-32, mixed bits promoting the 4-bit parts to 8-bit exactly (q in
    [0, 15] with its scale and minimum is a valid bits=8 weight; if any part has a minimum, the
    symmetric parts get a zero minimum, exact); any other mix is a StackedWeight of the parts."""
    if not parts:
        raise ValueError("concat of no weights")
    if len({p.shape[1] for p in parts}) != 1:
        raise ValueError(f"concat: in_features differ: {[p.shape[1] for p in parts]}")
    flat = [q for p in parts for q in (p.parts if isinstance(p, StackedWeight) else [p])]
    if (
        all(isinstance(p, RawSuperBlocks) and p._ints is None and p.device.type == "cpu" for p in flat)
        and len({p.kind for p in flat}) == 1
    ):
        raws: list[RawSuperBlocks] = flat  # type: ignore[assignment]
        return RawSuperBlocks(
            raws[0].kind, [b for p in raws for b in p.parts], raws[0].k, raws[0]._decode, raws[0].release
        )
    if all(isinstance(p, SuperBlockWeight) for p in flat) and len({p.kind for p in flat}) == 1:
        sbs: list[SuperBlockWeight] = flat  # type: ignore[assignment]
        cat = lambda ts: None if ts[0] is None else torch.cat(ts)  # noqa: E731
        return SuperBlockWeight(
            sbs[0].kind,
            torch.cat([p.q for p in sbs]),
            torch.cat([p.sc for p in sbs]),
            torch.cat([p.d for p in sbs]),
            cat([p.m for p in sbs]),
            cat([p.dmin for p in sbs]),
        )
    if all(still_in_blocks(p) and isinstance(p, RawGroupBlocks) for p in flat) and len({p.kind for p in flat}) == 1:
        groups: list[RawGroupBlocks] = flat  # type: ignore[assignment]
        first = groups[0]
        return RawGroupBlocks(
            first.bits, first.kind, [b for p in groups for b in p.parts], first.k, first._decode, first.release
        )
    if not all(isinstance(p, QuantizedWeight) for p in flat):
        runs: list[list[QuantizedWeight | SuperBlockWeight]] = []
        for p in flat:  # consecutive parts of one form are concatenated into one row block
            if runs and _form(runs[-1][-1]) == _form(p):
                runs[-1].append(p)
            else:
                runs.append([p])
        return StackedWeight([concat(run) for run in runs])  # type: ignore[misc]
    parts = flat
    bits = max(p.bits for p in parts)
    any_min = any(p.minimum is not None for p in parts)
    minimum = (
        torch.cat([p.minimum if p.minimum is not None else torch.zeros_like(p.scale) for p in parts])
        if any_min
        else None
    )
    return QuantizedWeight(
        bits=bits, q=torch.cat([p.q for p in parts]), scale=torch.cat([p.scale for p in parts]), minimum=minimum
    )
