"""Compute ops of our own: weight-only quantized linear layers (formats in quantized.py, packing and
dispatch in qlinear.py, the CPU kernel in csrc/). No model, file format or engine knowledge here.

Importing it asks MKL for float32 GEMMs whose rounding does not depend on the thread count
(`freetoken.utils.blas`): it must happen before torch's first float32 matmul in the process."""

from freetoken.utils.blas import reproducible_blas

reproducible_blas()

from freetoken.ops.qlinear import PackedWeight, kernel_available, qlinear  # noqa: E402
from freetoken.ops.quantized import GROUP, QuantizedWeight, concat, dequantize, quantize_int4, quantize_int8  # noqa: E402

__all__ = [
    "GROUP",
    "PackedWeight",
    "QuantizedWeight",
    "concat",
    "dequantize",
    "kernel_available",
    "qlinear",
    "quantize_int4",
    "quantize_int8",
]
