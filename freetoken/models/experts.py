"""A layer's mixture-of-experts weights and their grouped forward, shared by every MoE family.

Owns the experts of one layer: E gated MLPs `down(act(gate x, up x))`, each expert's gate and up
fused into one [2I, H] matrix and its down [H, I], held either as float tensors or packed for
`freetoken.ops.qlinear` (a group-32 QuantizedWeight: the loader's GGUF blocks, MXFP4 widened
exactly to 8 bits, or a `--weights int8|int4` quantization), never as a bfloat16 copy of a packed
expert. The forward is grouped: the tokens routed to one expert in a step are multiplied
together, one call per active expert.

Where the experts live between steps (`--moe-strategy`): `resident` decodes every expert at
load; `offload` (`offload_experts`, before loading) keeps only the backing store -- the
memory-mapped file's blocks (`weights.dequant.Deferred`) or the checkpoint's host tensors -- and
decodes an expert into the shared `ExpertCache` the first time it is routed to after an
eviction. Routing (router, top-k, weight normalisation) is the family's. It does not read files.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from freetoken.errors import ModelLoadError
from freetoken.models.experts_cache import ExpertCache
from freetoken.models.linear import apply_policy
from freetoken.ops.qlinear import PackedWeight, qlinear
from freetoken.ops.quantized import QuantizedWeight, concat, dequantize
from freetoken.weights.dequant import Deferred

# The family's gated activation: act(gate [n, I], up [n, I]) -> [n, I].
Activation = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
# One expert matrix [N, K] as a loader gives it.
Source = torch.Tensor | QuantizedWeight | Deferred
# One projection of all E experts: a float [E, N, K] tensor, or E per-expert sources.
ExpertStack = torch.Tensor | Sequence[Source]
# One expert matrix in the form its matmul reads.
Matrix = torch.Tensor | PackedWeight


def _policy(w: Source, weights: str) -> Source:
    if isinstance(w, Deferred):
        return Deferred(w.shape, w.nbytes, lambda: apply_policy(w.make(), weights))
    return apply_policy(w, weights)


def with_policy(stack: ExpertStack, weights: str) -> list[Source]:
    """Each expert matrix as the `--weights` policy says (`models.linear.apply_policy`); a
    deferred one when it is decoded."""
    return [_policy(stack[e], weights) for e in range(len(stack))]


def matmul(x: torch.Tensor, w: Matrix, bias: torch.Tensor | None) -> torch.Tensor:
    """x [n, K] @ w^T (+ bias) -> [n, N], in x's dtype."""
    if isinstance(w, PackedWeight):
        return qlinear(x, w, bias)
    return F.linear(x, w, bias)


def matrix_nbytes(w: Matrix) -> int:
    return w.nbytes if isinstance(w, PackedWeight) else w.numel() * w.element_size()


def _decoded(w: Source) -> torch.Tensor | QuantizedWeight:
    return w.make() if isinstance(w, Deferred) else w


def _pack(qw: QuantizedWeight, device: torch.device) -> PackedWeight:
    minimum = None if qw.minimum is None else qw.minimum.to(device)
    return PackedWeight(QuantizedWeight(qw.bits, qw.q.to(device), qw.scale.to(device), minimum))


def _float(w: torch.Tensor | QuantizedWeight, dtype: torch.dtype) -> torch.Tensor:
    return dequantize(w, dtype) if isinstance(w, QuantizedWeight) else w.to(dtype)


def fuse_gate_up(gate: Source, up: Source, dtype: torch.dtype, device: torch.device) -> Matrix:
    """One expert's gate [I, H] and up [I, H] -> its fused [2I, H] matrix (gate rows first):
    packed when both are quantized, else float in `dtype`."""
    g, u = _decoded(gate), _decoded(up)
    if isinstance(g, QuantizedWeight) and isinstance(u, QuantizedWeight):
        return _pack(concat([g, u]), device)
    return torch.cat([_float(g, dtype), _float(u, dtype)]).to(device).contiguous()


def as_matrix(w: Source, dtype: torch.dtype, device: torch.device) -> Matrix:
    """One expert matrix in the form its matmul reads. A float one is copied into memory of its
    own, never left a view into the checkpoint: MKL's float32 GEMM picks its kernel by address
    alignment, and an expert at an arbitrary offset of the file's map would compute last-bit
    differently from the same expert mapped back from the weight cache (64-byte aligned)."""
    d = _decoded(w)
    return _pack(d, device) if isinstance(d, QuantizedWeight) else d.to(device=device, dtype=dtype, copy=True).contiguous()


class Experts(nn.Module):
    """E experts of one layer; `forward` runs each token through its routed experts, weighted."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, act: Activation, bias: bool,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.num_experts, self.hidden, self.intermediate = num_experts, hidden, intermediate
        self.act, self.bias, self.dtype, self.device = act, bias, dtype, torch.device(device)
        self.gate_up: list[Matrix] = []  # resident: per expert [2I, H], gate rows then up rows
        self.down: list[Matrix] = []  # resident: per expert [H, I]
        self.gate_up_bias: torch.Tensor | None = None  # [E, 2I]
        self.down_bias: torch.Tensor | None = None  # [E, H]
        # offload: the cache shared by all layers, this layer's key in it, and per expert its
        # backing (gate, up, down) sources, decoded on a miss
        self.cache: ExpertCache | None = None
        self.key = 0
        self.backing: list[tuple[Source, Source, Source]] = []

    def load(self, gate: ExpertStack, up: ExpertStack, down: ExpertStack, gate_bias: torch.Tensor | None = None,
             up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None) -> None:
        """gate, up: [E, I, H]; down: [E, H, I] (a float tensor, or E QuantizedWeights / Deferred
        matrices); biases [E, I], [E, I], [E, H] when the layer has them. Resident: decoded now;
        offloaded: kept as the backing store."""
        E, H, I = self.num_experts, self.hidden, self.intermediate
        for name, stack, shape in (("gate", gate, (I, H)), ("up", up, (I, H)), ("down", down, (H, I))):
            if len(stack) != E or any(tuple(stack[e].shape) != shape for e in range(E)):
                got = [tuple(stack[e].shape) for e in range(min(len(stack), 2))]
                raise ModelLoadError(f"experts {name}: expected {E} x {list(shape)}, got {len(stack)} x {got}")
        if self.bias != (gate_bias is not None and up_bias is not None and down_bias is not None):
            raise ModelLoadError(f"experts: biases {'missing' if self.bias else 'unexpected'}")
        if self.cache is None:
            self.gate_up = [fuse_gate_up(gate[e], up[e], self.dtype, self.device) for e in range(E)]
            self.down = [as_matrix(down[e], self.dtype, self.device) for e in range(E)]
        else:
            self.backing = [(gate[e], up[e], down[e]) for e in range(E)]
        if gate_bias is not None and up_bias is not None and down_bias is not None:
            self.gate_up_bias = torch.cat([gate_bias, up_bias], dim=1).to(self.device, self.dtype).contiguous()
            self.down_bias = down_bias.to(self.device, self.dtype).contiguous()

    def _decode(self, e: int) -> tuple[tuple[Matrix, Matrix], int]:
        gate, up, down = self.backing[e]
        pair = (fuse_gate_up(gate, up, self.dtype, self.device), as_matrix(down, self.dtype, self.device))
        return pair, matrix_nbytes(pair[0]) + matrix_nbytes(pair[1])

    def matrices(self, e: int) -> tuple[Matrix, Matrix]:
        """Expert e's (gate_up [2I, H], down [H, I]): resident, or from the cache (decoded on a miss)."""
        if self.cache is None:
            return self.gate_up[e], self.down[e]
        return self.cache.get((self.key, e), lambda: self._decode(e))  # type: ignore[return-value]

    def runs_as(self) -> str:
        """What `ft inspect` prints for the experts: `int8`, `int4`, the float dtype, or `offloaded`."""
        if self.cache is not None:
            return "offloaded"
        w = self.gate_up[0]
        return f"int{w.bits} (group 32)" if isinstance(w, PackedWeight) else str(self.dtype).removeprefix("torch.")

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [T, H], expert_ids [T, k] long, weights [T, k] -> sum_j weights[:, j] * expert_j(x) [T, H]."""
        I = self.intermediate
        out = torch.zeros_like(x)  # [T, H]
        for e in expert_ids.unique().tolist():
            tok, rank = torch.where(expert_ids == e)  # tokens routed to e, and e's rank among their k
            gate_up_w, down_w = self.matrices(e)
            gb = self.gate_up_bias[e] if self.gate_up_bias is not None else None
            db = self.down_bias[e] if self.down_bias is not None else None
            gate_up = matmul(x[tok], gate_up_w, gb)  # [n, 2I]
            h = self.act(gate_up[:, :I], gate_up[:, I:])  # [n, I]
            y = matmul(h, down_w, db)  # [n, H]
            out.index_add_(0, tok, (y * weights[tok, rank, None]).to(out.dtype))
        return out


def experts_of(model: nn.Module) -> list[Experts]:
    return [m for m in model.modules() if isinstance(m, Experts)]


def offload_experts(model: nn.Module, cache: ExpertCache) -> None:
    """`--moe-strategy offload`: every Experts of `model` keeps its backing store and shares
    `cache`. Call before `load_weights`."""
    for key, experts in enumerate(experts_of(model)):
        if experts.gate_up:
            raise ModelLoadError("offload_experts must be called before the experts are loaded")
        experts.cache, experts.key = cache, key


def expert_status(model: nn.Module) -> dict[str, object] | None:
    """The `experts` section of `/v1/cache/status`: the strategy, the experts' count and, when
    offloaded, the cache's counters; None for a model without experts."""
    layers = experts_of(model)
    if not layers:
        return None
    count = sum(x.num_experts for x in layers)
    cache = layers[0].cache
    if cache is None:
        resident = sum(matrix_nbytes(w) for x in layers for w in (*x.gate_up, *x.down))
        return {"strategy": "resident", "experts": count, "resident_bytes": resident}
    return {"strategy": "offload", "experts": count, "cache": cache.status()}


def expert_cache(model: nn.Module) -> ExpertCache | None:
    """The offload cache `model`'s experts share, or None (resident, or no experts)."""
    layers = experts_of(model)
    return layers[0].cache if layers else None
