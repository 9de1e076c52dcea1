"""A layer's mixture-of-experts weights and their grouped forward, shared by every MoE family.

Owns the experts of one layer: E gated MLPs `down(act(gate x, up x))`, each expert's gate and up
fused into one [2I, H] matrix and its down [H, I], held either as float tensors or packed for
`freetoken.ops.qlinear` (a group-32 QuantizedWeight: the loader's GGUF blocks, MXFP4 widened
exactly to 8 bits, or a `--weights int8|int4` quantization), never as a bfloat16 copy of a packed
expert. The forward is grouped: the tokens routed to one expert in a step are multiplied
together, one call per active expert. Routing (router, top-k, weight normalisation) is the
family's; where an expert's weights live between steps (resident, or an offload cache over a
backing store) is `models.experts_cache`'s. It does not read files.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from freetoken.errors import ModelLoadError
from freetoken.models.linear import apply_policy
from freetoken.ops.qlinear import PackedWeight, qlinear
from freetoken.ops.quantized import QuantizedWeight, concat, dequantize

# The family's gated activation: act(gate [n, I], up [n, I]) -> [n, I].
Activation = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
# One projection of all E experts as the loader gives it: a float [E, N, K] tensor, or E
# per-expert matrices [N, K], each a QuantizedWeight (or a float tensor where one could not stay packed).
ExpertStack = torch.Tensor | Sequence[torch.Tensor | QuantizedWeight]
# One expert matrix in the form its matmul reads.
Matrix = torch.Tensor | PackedWeight


def every_other_row(w: torch.Tensor | QuantizedWeight, first: int) -> torch.Tensor | QuantizedWeight:
    """Rows first, first + 2, ... of one expert matrix (de-interleaving a fused gate/up)."""
    if isinstance(w, QuantizedWeight):
        m = None if w.minimum is None else w.minimum[first::2].contiguous()
        return QuantizedWeight(w.bits, w.q[first::2].contiguous(), w.scale[first::2].contiguous(), m)
    return w[..., first::2, :]


def with_policy(stack: ExpertStack, weights: str) -> list[torch.Tensor | QuantizedWeight]:
    """Each expert matrix as the `--weights` policy says (`models.linear.apply_policy`)."""
    return [apply_policy(stack[e], weights) for e in range(len(stack))]


def matmul(x: torch.Tensor, w: Matrix, bias: torch.Tensor | None) -> torch.Tensor:
    """x [n, K] @ w^T (+ bias) -> [n, N], in x's dtype."""
    if isinstance(w, PackedWeight):
        return qlinear(x, w, bias)
    return F.linear(x, w, bias)


def matrix_nbytes(w: Matrix) -> int:
    return w.nbytes if isinstance(w, PackedWeight) else w.numel() * w.element_size()


def _shape(w: torch.Tensor | QuantizedWeight) -> tuple[int, int]:
    return tuple(w.shape)  # type: ignore[return-value]


def fuse_gate_up(gate: torch.Tensor | QuantizedWeight, up: torch.Tensor | QuantizedWeight,
                 dtype: torch.dtype, device: torch.device | str) -> Matrix:
    """One expert's gate [I, H] and up [I, H] -> its fused [2I, H] matrix (gate rows first)."""
    if isinstance(gate, QuantizedWeight) and isinstance(up, QuantizedWeight):
        return pack(concat([gate, up]), device)
    return torch.cat([_float(gate, dtype), _float(up, dtype)]).to(device=device, dtype=dtype).contiguous()


def as_matrix(w: torch.Tensor | QuantizedWeight, dtype: torch.dtype, device: torch.device | str) -> Matrix:
    if isinstance(w, QuantizedWeight):
        return pack(w, device)
    return w.to(device=device, dtype=dtype).contiguous()


def pack(qw: QuantizedWeight, device: torch.device | str) -> PackedWeight:
    minimum = None if qw.minimum is None else qw.minimum.to(device)
    return PackedWeight(QuantizedWeight(qw.bits, qw.q.to(device), qw.scale.to(device), minimum))


def _float(w: torch.Tensor | QuantizedWeight, dtype: torch.dtype) -> torch.Tensor:
    return dequantize(w, dtype) if isinstance(w, QuantizedWeight) else w


class Experts(nn.Module):
    """E experts of one layer; `forward` runs each token through its routed experts, weighted."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, act: Activation, bias: bool,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.num_experts, self.hidden, self.intermediate = num_experts, hidden, intermediate
        self.act, self.bias, self.dtype, self.device = act, bias, dtype, torch.device(device)
        self.gate_up: list[Matrix] = []  # per expert [2I, H]: gate rows, then up rows
        self.down: list[Matrix] = []  # per expert [H, I]
        self.gate_up_bias: torch.Tensor | None = None  # [E, 2I]
        self.down_bias: torch.Tensor | None = None  # [E, H]

    def load(self, gate: ExpertStack, up: ExpertStack, down: ExpertStack, gate_bias: torch.Tensor | None = None,
             up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None) -> None:
        """gate, up: [E, I, H]; down: [E, H, I] (a float tensor, or E QuantizedWeights each);
        biases [E, I], [E, I], [E, H] when the layer has them."""
        E, H, I = self.num_experts, self.hidden, self.intermediate
        for name, stack, shape in (("gate", gate, (I, H)), ("up", up, (I, H)), ("down", down, (H, I))):
            if len(stack) != E or any(_shape(stack[e]) != shape for e in range(E)):
                got = [_shape(stack[e]) for e in range(min(len(stack), 2))]
                raise ModelLoadError(f"experts {name}: expected {E} x {list(shape)}, got {len(stack)} x {got}")
        if self.bias != (gate_bias is not None and up_bias is not None and down_bias is not None):
            raise ModelLoadError(f"experts: biases {'missing' if self.bias else 'unexpected'}")
        self.gate_up = [fuse_gate_up(gate[e], up[e], self.dtype, self.device) for e in range(E)]
        self.down = [as_matrix(down[e], self.dtype, self.device) for e in range(E)]
        if gate_bias is not None and up_bias is not None and down_bias is not None:
            self.gate_up_bias = torch.cat([gate_bias, up_bias], dim=1).to(self.device, self.dtype).contiguous()
            self.down_bias = down_bias.to(self.device, self.dtype).contiguous()

    def runs_as(self) -> str:
        """What `ft inspect` prints for the experts: `int8`, `int4` or the float dtype."""
        w = self.gate_up[0] if self.gate_up else None
        return f"int{w.bits} (group 32)" if isinstance(w, PackedWeight) else str(self.dtype).removeprefix("torch.")

    @property
    def nbytes(self) -> int:
        return sum(matrix_nbytes(w) for w in (*self.gate_up, *self.down))

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [T, H], expert_ids [T, k] long, weights [T, k] -> sum_j weights[:, j] * expert_j(x) [T, H]."""
        I = self.intermediate
        out = torch.zeros_like(x)  # [T, H]
        for e in expert_ids.unique().tolist():
            tok, rank = torch.where(expert_ids == e)  # tokens routed to e, and e's rank among their k
            gb = self.gate_up_bias[e] if self.gate_up_bias is not None else None
            db = self.down_bias[e] if self.down_bias is not None else None
            gate_up = matmul(x[tok], self.gate_up[e], gb)  # [n, 2I]
            h = self.act(gate_up[:, :I], gate_up[:, I:])  # [n, I]
            y = matmul(h, self.down[e], db)  # [n, H]
            out.index_add_(0, tok, (y * weights[tok, rank, None]).to(out.dtype))
        return out
