"""What each weight matrix of a loaded model runs as: the per-weight plan and its one-line summary.

Owns naming a loaded matrix's format the way the kernels will read it — the packed form's own
name (`int4`, `int5` for an 8-bit weight whose integers fit 5 bits, `int8`, `q4_k`, `q6_k`, parts
joined by ` + ` for a fused projection of mixed types) or the float dtype — for every linear layer and embedding (by module name) and every resident expert matrix
(`name.gate_up.E`, `name.down.E`). Tensor parallelism compares these plans across ranks (a rank
whose shard runs a matrix in another format computes another model) and `ft serve` logs the
summary per rank. It does not choose formats (the `--weights` policy and the packing do).
"""

from __future__ import annotations

from collections import Counter

import torch
from torch import nn

from freetoken.models.experts import Experts
from freetoken.models.linear import QuantizableWeight


def _format(matrix: object, dtype: torch.dtype) -> str:
    """A packed matrix's `format`; a float one's dtype."""
    fmt = getattr(matrix, "format", None)
    if isinstance(fmt, str):
        return fmt
    return str(getattr(matrix, "dtype", dtype)).removeprefix("torch.")


def weight_formats(model: nn.Module) -> dict[str, str]:
    """Module name (expert matrices: `name.gate_up.E` / `name.down.E`) -> its format, in module order.
    Offloaded experts are decoded on demand; they count as one entry `offloaded`."""
    plan: dict[str, str] = {}
    for name, module in model.named_modules():
        if isinstance(module, QuantizableWeight):
            plan[name] = _format(module.packed if module.packed is not None else module.weight, module.dtype)
        elif isinstance(module, Experts):
            if module.cache is not None:
                plan[name] = "offloaded"
                continue
            if module.local is not None:  # expert parallelism: ranks hold different experts; compare the forms
                for kind in ("gate_up", "down"):
                    forms = sorted({_format(m, module.dtype) for k, _, m in module.resident() if k == kind})
                    plan[f"{name}.{kind}"] = " | ".join(forms)
                continue
            for kind, e, m in module.resident():
                plan[f"{name}.{kind}.{e}"] = _format(m, module.dtype)
    return plan


def summary(plan: dict[str, str]) -> str:
    """`73 matrices: int4 x27, int5 x27, int8 x19` (formats in name order)."""
    counts = Counter(plan.values())
    return f"{len(plan)} matrices: " + ", ".join(f"{k} x{n}" for k, n in sorted(counts.items()))


def first_difference(mine: dict[str, str], other: dict[str, str]) -> str | None:
    """The first matrix whose format differs between two plans (or that one of them lacks),
    as `name: a vs b`; None when they are the same."""
    for name in [*mine, *(n for n in other if n not in mine)]:
        a, b = mine.get(name, "absent"), other.get(name, "absent")
        if a != b:
            return f"{name}: {a} vs {b}"
    return None
