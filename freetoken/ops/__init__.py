"""Compute ops of our own: weight-only quantized linear layers (formats in quantized.py, packing and
dispatch in qlinear.py, the CPU kernel in csrc/). No model, file format or engine knowledge here."""

from freetoken.ops.qlinear import PackedWeight, kernel_available, qlinear
from freetoken.ops.quantized import GROUP, QuantizedWeight, concat, dequantize, quantize_int4, quantize_int8

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
