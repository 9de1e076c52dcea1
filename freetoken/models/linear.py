"""Linear layers and embeddings whose weight is either a float tensor or a packed quantized one.

Owns the `--weights` policy (`auto | bf16 | int8 | int4`) as it applies to one weight at load
time, and the two modules every family builds its projections from. A quantized weight runs
through `freetoken.ops.qlinear` (our kernel for decode-sized batches, torch otherwise); with
`--prefill-weights bf16` a linear layer also keeps its matrix dequantized to the model dtype and
multiplies prefill-sized batches (PREFILL_ROWS rows or more) by it; `auto` keeps that copy only
where the kernel is slower than the copy at prefill sizes (`keeps_dense_copy`). An embedding over a
quantized table dequantizes only the rows it reads, and a tied output head multiplies by the
same packed table. It does not read files or choose kernels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from freetoken.config import WEIGHT_POLICIES
from freetoken.errors import ModelLoadError
from freetoken.ops.qlinear import PREFILL_ROWS, Packed, pack, qlinear, runs_on_torch
from freetoken.ops.superblock import PackedColumns, PackedStack, PackedSuperBlock
from freetoken.ops.quantized import (
    GROUP,
    ColumnOrderedWeight,
    Quantized,
    QuantizedWeight,
    StackedWeight,
    SuperBlockWeight,
    dequantize,
    is_quantized,
    on_device,
    quantize_int4,
    quantize_int8,
)


# A checkpoint tensor: float, or one of the integer forms a quantized GGUF matrix loads into.
Weight = torch.Tensor | Quantized


def check_policy(weights: str) -> None:
    if weights not in WEIGHT_POLICIES:
        raise ModelLoadError(f"--weights must be one of {', '.join(WEIGHT_POLICIES)}, got {weights!r}")


def _promote_to_int8(qw: QuantizedWeight) -> QuantizedWeight:
    """4-bit integers in [0, 15] with their scale and minimum are exactly a valid 8-bit weight."""
    return QuantizedWeight(8, qw.q, qw.scale, qw.minimum)


def apply_policy(value: Weight, weights: str) -> Weight:
    """What a quantizable matrix runs as under `weights`: `auto` keeps the checkpoint's form
    (Q4_K / Q6_K in their own integers, another 4-bit file type 4-bit, a 5/8-bit one 8-bit, a
    float one float); `bf16` is the model dtype (floats); `int8` / `int4` quantize to the group-32
    form (4-bit integers widen to 8 bits exactly)."""
    if weights == "auto":
        return value
    if weights == "bf16":
        return dequantize(value, torch.float32) if is_quantized(value) else value
    if isinstance(value, (StackedWeight, ColumnOrderedWeight)):
        value = dequantize(value, torch.float32)
    if isinstance(value, SuperBlockWeight):
        value = value.to_group32()
    if isinstance(value, QuantizedWeight):
        if weights == "int8":
            return value if value.bits == 8 else _promote_to_int8(value)
        return value if value.bits == 4 else quantize_int4(dequantize(value, torch.float32))
    if value.shape[-1] % GROUP != 0:
        return value  # rows that are not whole groups stay float
    return quantize_int8(value.float()) if weights == "int8" else quantize_int4(value.float())


class QuantizableWeight(nn.Module):
    """The weight [out, in] shared by Linear and Embedding: a float Parameter until
    `load_quantized` swaps it for its packed form (the Parameter is then dropped)."""

    weight: nn.Parameter | None

    def __init__(self, n_rows: int, n_cols: int, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        # Uninitialised (the checkpoint fills it); untouched pages of torch.empty cost no memory.
        self.weight = nn.Parameter(torch.empty(n_rows, n_cols, dtype=dtype, device=device))
        self.dtype = dtype
        self.packed: Packed | None = None
        # The quantized matrix dequantized once to `dtype`, for prefill-sized row counts (bf16
        # GEMM beats the decode kernel ~2x from PREFILL_ROWS rows on); None: not kept.
        self.dense: torch.Tensor | None = None
        # Row counts from which `dense` multiplies: PREFILL_ROWS, or 1 where the packed form runs
        # on torch's fallback (`keeps_dense_copy`); decided with the copy, not on every call.
        self.dense_from = PREFILL_ROWS
        # Multiply one row at a time (a float matrix under --deterministic: a GEMM's rounding
        # follows its row count; engine/deterministic.py sets it).
        self.rows_alone = False

    def load_quantized(self, qw: Quantized) -> None:
        if self.weight is None:
            raise ModelLoadError("a quantized weight was loaded twice into one layer")
        if tuple(qw.shape) != tuple(self.weight.shape):
            raise ModelLoadError(f"quantized weight {tuple(qw.shape)} where {tuple(self.weight.shape)} is expected")
        device = self.weight.device
        self.weight = None
        self.packed = pack(on_device(qw, device))

    def restore_packed(self, packed: Packed, dense: torch.Tensor | None) -> None:
        """Take a packed matrix (and its prefill copy) as `load_quantized` and `keep_dense_copy`
        made them on an earlier load (models/snapshot.py)."""
        if self.weight is None or (packed.out_features, packed.in_features) != tuple(self.weight.shape):
            raise ModelLoadError(f"packed weight {packed.out_features}x{packed.in_features} does not fit this layer")
        self.weight = None
        self.packed, self.dense = packed, dense
        self.dense_from = 1 if runs_on_torch(packed) else PREFILL_ROWS

    def runs_as(self) -> str:
        """What `ft inspect` prints for this weight: `int8 (group 32)`, `int4 (group 32)`, `q4_k`,
        `q6_k`, parts joined by ` + ` for a fused projection of mixed types, or the float dtype."""
        if self.packed is not None:
            fmt = self.packed.format
            return f"{fmt} (group {GROUP})" if fmt.startswith("int") and "+" not in fmt else fmt
        return str(self.dtype).removeprefix("torch.")

    def keep_dense_copy(self) -> None:
        """Also hold the quantized weight dequantized to the model dtype, for prefill."""
        if self.packed is not None:
            self.dense = self.packed.dequantize(self.dtype)
            self.dense_from = 1 if runs_on_torch(self.packed) else PREFILL_ROWS

    def project(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, in] -> x W^T (+ bias) [T, out]."""
        if self.packed is not None:
            if self.dense is not None and x.shape[0] >= self.dense_from:
                return dense_linear(x, self.dense, bias)
            return qlinear(x, self.packed, bias)
        if self.rows_alone and x.shape[0] > 1:
            return torch.cat([F.linear(row, self.weight, bias) for row in x.split(1)])
        return dense_linear(x, self.weight, bias)


# The LM head multiplies the rows that are sampled (one a sequence), not the prompt: a prefill-sized
# batch reaches it only for prompt logprobs.
HEAD = "lm_head.weight"


def _kernel_keeps_up(packed: Packed) -> bool:
    """Whether `packed` multiplies a prefill batch about as fast through the kernel as through a
    bf16 copy. Measured (docs/engineering/kernels.md, "Prefill copies"): q4_k's sbmm at 512 rows of a 1.1B's shapes
    is 0.9-1.0x the bf16 GEMM's time; q6_k's is ~1.9x (its scale epilogue per 16 weights), and the
    group-32 kernel's ~2x. A fused projection keeps up only if every part does."""
    if isinstance(packed, PackedStack):
        return all(_kernel_keeps_up(p) for p in packed.parts)
    if isinstance(packed, PackedColumns):
        return _kernel_keeps_up(packed.inner)
    return isinstance(packed, PackedSuperBlock) and packed.kind == "q4_k"


def keeps_dense_copy(prefill_weights: str, layer: QuantizableWeight, name: str) -> bool:
    """Under `--prefill-weights` (bf16 | auto | quantized), whether the quantized linear layer (or
    tied embedding) loaded as `name` also holds a copy in the model dtype for prefill: bf16 always, quantized
    never, auto where the kernel is slower (`_kernel_keeps_up`) and the copy is 16-bit, and never for
    the LM head. A float32 model (a CPU without a bfloat16 unit, or `--dtype float32`) keeps no copy
    under auto: at 4 bytes a weight it held 3.7x a Q8_0 1.1B's file for a prefill only 1.1x faster
    (docs/engineering/kernels.md, "Prefill copies") —
    except that, whatever the setting, a layer whose form runs on torch's fallback here (`runs_on_torch`:
    group-32 weights on a CPU without AVX-512) keeps one, head and tied embedding included (whose
    table rows are still read packed), used at every row count:
    the fallback dequantizes the whole matrix on every call (the bundled Gemma's decode step took
    seconds on an AVX2-only Zen 3)."""
    if layer.packed is None:
        return False
    if runs_on_torch(layer.packed):
        return True
    if prefill_weights == "quantized":
        return False
    if not isinstance(layer, Linear):  # an embedding table: its rows are read packed
        return False
    if prefill_weights == "bf16":
        return True
    return layer.dtype.itemsize == 2 and name != HEAD and not _kernel_keeps_up(layer.packed)


# Prefill row counts are rounded up to a multiple of this for the dense GEMM on CPU: oneDNN keeps
# a primitive (and its memory) per shape it has seen, so every distinct chunk length grew the
# engine's RSS (+356 MiB over the hour-long soak); rounded, the shapes are few and reused.
ROW_BUCKET = 32


def dense_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear(x, w, bias), with x's rows padded to a multiple of ROW_BUCKET on CPU from
    PREFILL_ROWS rows on (the padding rows are dropped: y is x's rows only)."""
    rows = x.shape[0]
    if x.device.type != "cpu" or x.dim() != 2 or rows < PREFILL_ROWS or rows % ROW_BUCKET == 0:
        return F.linear(x, w, bias)
    padded = x.new_zeros(-(-rows // ROW_BUCKET) * ROW_BUCKET, x.shape[1])
    padded[:rows] = x
    return F.linear(padded, w, bias)[:rows]


class Linear(QuantizableWeight):
    """y = x W^T + b over [T, in] -> [T, out]. `quantizable=False` keeps the weight float
    whatever the policy (a router, whose choices a coarse grid would change)."""

    def __init__(
        self,
        n_in: int,
        n_out: int,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device | str,
        quantizable: bool = True,
    ) -> None:
        super().__init__(n_out, n_in, dtype, device)
        self.bias = nn.Parameter(torch.empty(n_out, dtype=dtype, device=device)) if bias else None
        self.quantizable = quantizable

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.project(x, self.bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """`forward` without nn.Module's hook dispatch (~0.6 us a call, four linear layers per
        block and step). Nothing hooks a linear layer: tensor parallelism hooks whole attention
        and MLP blocks (models/shard.py), whose calls keep nn.Module's."""
        return self.forward(x)


class Embedding(QuantizableWeight):
    """Token ids [T] -> rows [T, dim] of the table [vocab, dim]; `project` is the tied output head."""

    quantizable = True

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return self.packed.rows(ids, self.dtype)
        return F.embedding(ids, self.weight)
