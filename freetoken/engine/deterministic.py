"""What `--deterministic` asks of a loaded model, checked once when the engine is built.

Owns the conditions under which every row of a step is computed alike whatever it is batched,
chunked or cached with: the matrices are quantized (our kernels give a row the same bits at any
row count; a float GEMM's rounding follows its row count), the attention is the query-by-query
decode kernel (an AVX-512 build, no soft-capping or sinks, which only the torch reference takes),
and the float layers that stay float by design (an MoE router) multiply one row at a time. A
model that cannot keep the promise is refused in one line naming what to change. The runtime
half is elsewhere: `EngineConfig.alone_max` (every chunk attended query by query) and
`EngineConfig.copies_for_prefill` (no dense prefill copies).
"""

from __future__ import annotations

import torch
from torch import nn

from freetoken.errors import ConfigError
from freetoken.models.config import ModelConfig
from freetoken.models.formats import weight_formats
from freetoken.models.linear import Linear
from freetoken.ops.attention import kernel_available


def prepare_deterministic(model: nn.Module, config: ModelConfig, dtype: torch.dtype, on: bool) -> None:
    """Under --deterministic (`on`), refuse a model it cannot serve exactly (ConfigError); set the
    float layers that stay float by design to multiply row by row when on, and back when not (an
    engine built over a model another engine used)."""
    kept_float = {name: m for name, m in model.named_modules() if isinstance(m, Linear) and not m.quantizable}
    if on:
        if not kernel_available():
            raise ConfigError(
                "--deterministic needs the AVX-512 decode attention kernel (csrc/attention.cpp), "
                "which this CPU or build does not have"
            )
        if dtype not in (torch.bfloat16, torch.float32) or config.head_dim % 16:
            raise ConfigError(
                f"--deterministic's attention kernel takes bfloat16 or float32 and heads of a multiple "
                f"of 16; this model runs {str(dtype).removeprefix('torch.')} with heads of {config.head_dim}"
            )
        if config.attn_logit_softcapping is not None or any(n.endswith("sinks") for n, _ in model.named_parameters()):
            raise ConfigError(
                f"--deterministic: {config.architecture}'s attention (soft-capping or sinks) has no "
                "query-by-query kernel yet"
            )
        for name, fmt in weight_formats(model).items():
            if fmt in _FLOATS and name not in kept_float:
                raise ConfigError(
                    f"--deterministic needs quantized matrices and {name} is {fmt}: serve a GGUF, "
                    "or pass --weights int8"
                )
    for module in kept_float.values():
        module.rows_alone = on


_FLOATS = ("float32", "bfloat16", "float16")
