"""Weight-only quantized linear layers on CUDA: a group-32 int4 / int8 weight in a plain row layout
and a Triton kernel that multiplies by it, dequantizing in registers.

Owns `TritonPackedWeight` (the layout, built once at load: bits 8, the int8 integers [N, K] as they
are; bits 4, uint8 [N, K / 2] with weight 2j in the low nibble of byte j and 2j + 1 in the high one;
float16 scale and minimum [N, K / 32] as `QuantizedWeight` has them) and the kernel: a program
computes a [BLOCK_M, BLOCK_N] tile of y = x W^T over one run of K, each [BLOCK_N, BLOCK_K] weight
tile read once, dequantized (q * scale + minimum) and multiplied on the tensor cores. Decode-sized
batches give few output tiles, so K is split over programs until the GPU is full; the splits'
float32 partial sums are added in torch (no atomics: the result does not depend on timing). The
format math is quantized.py's (`dequantize` is the oracle the tests hold this to); the choice of
this path is qlinear.py's. Runs on CUDA tensors, and on CPU tensors under Triton's interpreter
(tests only; there the products are taken in float32, as the interpreter's bfloat16 dot is wrong).
Importing it needs triton.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from freetoken.ops.quantized import GROUP, QuantizedWeight


@triton.jit
def _qmm_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    mn_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    k_blocks_per_split,
    BITS: tl.constexpr,
    HAS_MIN: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    split = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < N
    GPB: tl.constexpr = BLOCK_K // 32  # groups per K block
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    kb0 = split * k_blocks_per_split
    for kb in range(kb0, kb0 + k_blocks_per_split):
        k0 = kb * BLOCK_K
        rk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=m_ok[:, None] & (rk[None, :] < K), other=0.0)
        if BITS == 4:
            rb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            packed = tl.load(
                w_ptr + rn[:, None].to(tl.int64) * (K // 2) + rb[None, :],
                mask=n_ok[:, None] & (rb[None, :] < K // 2),
                other=0,
            )
            q = tl.interleave(packed & 15, packed >> 4).to(tl.float32)  # [BLOCK_N, BLOCK_K], weights in order
        else:
            q = tl.load(
                w_ptr + rn[:, None].to(tl.int64) * K + rk[None, :], mask=n_ok[:, None] & (rk[None, :] < K), other=0
            ).to(tl.float32)
        rg = k0 // 32 + tl.arange(0, GPB)
        g_mask = n_ok[:, None] & (rg[None, :] < K // 32)
        s = tl.load(s_ptr + rn[:, None].to(tl.int64) * (K // 32) + rg[None, :], mask=g_mask, other=0.0).to(tl.float32)
        w = tl.reshape(q, (BLOCK_N, GPB, 32)) * s[:, :, None]
        if HAS_MIN:
            mn = tl.load(mn_ptr + rn[:, None].to(tl.int64) * (K // 32) + rg[None, :], mask=g_mask, other=0.0)
            w = w + mn.to(tl.float32)[:, :, None]
        w = tl.reshape(w, (BLOCK_N, BLOCK_K))
        if DOT_F32:
            acc += tl.dot(x.to(tl.float32), tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w.to(x.dtype)))
    out = out_ptr + split * M * N + rm[:, None] * N + rn[None, :]
    tl.store(out, acc, mask=m_ok[:, None] & n_ok[None, :])


@functools.cache
def _programs_to_fill(device: torch.device) -> int:
    """Programs that keep every streaming multiprocessor of `device` busy (a few on a CPU)."""
    if device.type != "cuda":
        return 4
    return 2 * torch.cuda.get_device_properties(device).multi_processor_count


def _blocks(m: int) -> int:
    return 16 if m <= 16 else 32 if m <= 32 else 64


BLOCK_N = 64
BLOCK_K = 128


def qmm(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    minimum: torch.Tensor | None,
    bits: int,
    bias: torch.Tensor | None = None,
    split_k: int | None = None,
) -> torch.Tensor:
    """y [M, N] = x [M, K] @ W^T (+ bias) in x's dtype, W [N, K] given in `TritonPackedWeight`'s layout."""
    M, K = x.shape
    N = scale.shape[0]
    if x.stride(1) != 1:
        x = x.contiguous()
    block_m = _blocks(M)
    tiles = triton.cdiv(M, block_m) * triton.cdiv(N, BLOCK_N)
    k_blocks = triton.cdiv(K, BLOCK_K)
    splits = split_k or max(1, min(k_blocks // 4, triton.cdiv(_programs_to_fill(x.device), tiles)))
    per_split = triton.cdiv(k_blocks, splits)
    splits = triton.cdiv(k_blocks, per_split)  # no split left without blocks
    partial = torch.empty(splits, M, N, dtype=torch.float32, device=x.device)
    _qmm_kernel[(triton.cdiv(M, block_m), triton.cdiv(N, BLOCK_N), splits)](
        x,
        packed,
        scale,
        minimum if minimum is not None else scale,
        partial,
        M,
        N,
        K,
        x.stride(0),
        per_split,
        BITS=bits,
        HAS_MIN=minimum is not None,
        BLOCK_M=block_m,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
        DOT_F32=x.dtype == torch.float32 or x.device.type == "cpu",
    )
    y = partial[0] if splits == 1 else partial.sum(dim=0)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def pack_rows(q: torch.Tensor, bits: int) -> torch.Tensor:
    """int8 [N, K] -> the kernel's rows: bits 8 as they are; bits 4 (values in [0, 15]) two per byte."""
    if bits == 8:
        return q.contiguous()
    u = q.to(torch.uint8)
    return (u[:, 0::2] | (u[:, 1::2] << 4)).contiguous()


def unpack_rows(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of pack_rows -> int8 [R, K]."""
    if bits == 8:
        return packed
    return torch.stack([packed & 15, packed >> 4], dim=2).reshape(packed.shape[0], -1).to(torch.int8)


class TritonPackedWeight:
    """A group-32 quantized [N, K] weight in the Triton kernel's layout, built once at load; the
    interface of qlinear.PackedWeight (`qlinear` calls `_small` / `_large`, the embedding `rows`)."""

    def __init__(self, qw: QuantizedWeight) -> None:
        self.out_features, self.in_features = qw.shape
        self.bits = qw.bits
        self.packed = pack_rows(qw.q, qw.bits)
        self.scale = qw.scale.contiguous()
        self.minimum = qw.minimum.contiguous() if qw.minimum is not None else None
        self._small = self._large = TritonPackedWeight._matmul

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return qmm(x, self.packed, self.scale, self.minimum, self.bits, bias)

    def state(self) -> dict:
        """The packed form as plain values, for `from_state` (the weight cache)."""
        return {
            "form": "triton_group32",
            "shape": [self.out_features, self.in_features],
            "bits": self.bits,
            "packed": self.packed,
            "scale": self.scale,
            "minimum": self.minimum,
        }

    @staticmethod
    def from_state(state: dict) -> TritonPackedWeight:
        self = TritonPackedWeight.__new__(TritonPackedWeight)
        self.out_features, self.in_features = state["shape"]
        self.bits, self.packed, self.scale, self.minimum = (
            state["bits"],
            state["packed"],
            state["scale"],
            state["minimum"],
        )
        self._small = self._large = TritonPackedWeight._matmul
        return self

    @property
    def format(self) -> str:
        return f"int{self.bits}"

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scale, self.minimum) if t is not None)

    def __repr__(self) -> str:
        return f"TritonPackedWeight({self.out_features}x{self.in_features}, bits={self.bits})"

    def _scaled(self, packed: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor | None, dtype: torch.dtype):  # type: ignore[no-untyped-def]
        q = unpack_rows(packed, self.bits)
        r, k = q.shape
        w = q.float().view(r, k // GROUP, GROUP) * scale.float().unsqueeze(2)
        if minimum is not None:
            w = w + minimum.float().unsqueeze(2)
        return w.view(r, k).to(dtype)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """Rows `ids` of the dequantized weight (an embedding lookup): ids.shape + [K]."""
        flat = ids.reshape(-1)
        m = self.minimum.index_select(0, flat) if self.minimum is not None else None
        out = self._scaled(self.packed.index_select(0, flat), self.scale.index_select(0, flat), m, dtype)
        return out.view(*ids.shape, self.in_features)

    def rows_range(self, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
        m = self.minimum[start:stop] if self.minimum is not None else None
        return self._scaled(self.packed[start:stop], self.scale[start:stop], m, dtype)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.rows_range(0, self.out_features, dtype)
