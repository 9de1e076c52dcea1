"""A layer's mixture-of-experts weights and their grouped forward, shared by every MoE family.

Owns the experts of one layer: E gated MLPs `down(act(gate x, up x))`, each expert's gate and up
fused into one [2I, H] matrix and its down [H, I], held either as float tensors or packed for
`freetoken.ops.qlinear` (`pack`: GGUF Q4_K / Q6_K in their own integers where the CPU kernel takes
them, else group-32 integers -- the loader's other GGUF blocks, MXFP4 widened exactly to 8 bits,
a `--weights int8|int4` quantization), never as a bfloat16 copy of a packed expert. The forward is
grouped: the tokens routed to one expert in a step are multiplied together. Resident super-block
experts run every active expert of a step in one kernel call per projection
(`ops.superblock.grouped_matmul`); other forms take one call per active expert.

Where the experts live between steps (`--moe-strategy`): `resident` decodes every expert at
load; `offload` (`offload_experts`, before loading) keeps only the backing store -- the
memory-mapped file's blocks (`weights.dequant.Deferred`) or the checkpoint's host tensors -- and
decodes an expert into the shared `ExpertCache` the first time it is routed to after an
eviction. Also what every MoE family's loader and router share: `take_experts`, which turns a
layer's expert tensors in any of the forms checkpoints hold them (transformers' stacks
`gate_up_proj` [E, 2I, H] with gate rows first and `down_proj` [E, H, I], the hub's per-expert
matrices, the GGUF loader's packed per-expert lists) into `Experts.load`'s gate / up / down;
`silu_gate` (SwiGLU) and `router_dtype` (a router's dtype: float32 under a half dtype). Routing
(router, top-k, weight normalisation) is the family's. It does not read files.

Under expert parallelism (`models.shard`, tensor parallelism of a Qwen3-MoE) a layer holds only the
experts in `local` and `combine` (an all-reduce) puts the ranks' per-pair outputs together before
they are summed per token, in the same order as one rank sums them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from freetoken.errors import ModelLoadError
from freetoken.models.experts_cache import ExpertCache
from freetoken.models.linear import Weight, apply_policy
from freetoken.ops.qlinear import Packed, PackedWeight, grouped_matmul_available, pack, qlinear
from freetoken.ops.quantized import QuantizedWeight, SuperBlockWeight, concat, dequantize, is_quantized, on_device
from freetoken.ops.superblock import PackedSuperBlock, grouped_matmul
from freetoken.weights.dequant import Deferred

# The family's gated activation: act(gate [n, I], up [n, I]) -> [n, I].
Activation = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
# One expert matrix [N, K] as a loader gives it.
Source = torch.Tensor | QuantizedWeight | SuperBlockWeight | Deferred
# One projection of all E experts: a float [E, N, K] tensor, or E per-expert sources.
ExpertStack = torch.Tensor | Sequence[Source]
# One expert matrix in the form its matmul reads.
Matrix = torch.Tensor | Packed


def silu_gate(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU of one expert: gate, up [n, I] -> silu(gate) * up [n, I]."""
    return F.silu(gate) * up


def router_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a router is held and multiplied in: float32 under a half compute dtype."""
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


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
    if isinstance(w, torch.Tensor):
        return F.linear(x, w, bias)
    return qlinear(x, w, bias)


def matrix_nbytes(w: Matrix) -> int:
    return w.numel() * w.element_size() if isinstance(w, torch.Tensor) else w.nbytes


Decoded = torch.Tensor | QuantizedWeight | SuperBlockWeight


def _decoded(w: Source) -> Decoded:
    return w.make() if isinstance(w, Deferred) else w


def _pack(qw: QuantizedWeight | SuperBlockWeight, device: torch.device) -> Packed:
    return pack(on_device(qw, device))


def _float(w: Decoded, dtype: torch.dtype) -> torch.Tensor:
    return dequantize(w, dtype) if is_quantized(w) else w.to(dtype)  # type: ignore[arg-type]


def fuse_gate_up(gate: Source, up: Source, dtype: torch.dtype, device: torch.device) -> Matrix:
    """One expert's gate [I, H] and up [I, H] -> its fused [2I, H] matrix (gate rows first):
    packed when both are quantized, else float in `dtype`."""
    g, u = _decoded(gate), _decoded(up)
    if is_quantized(g) and is_quantized(u):
        fused = concat([g, u])  # type: ignore[list-item]
        if not isinstance(fused, (QuantizedWeight, SuperBlockWeight)):  # two forms: both group-32
            fused = concat([_group32(g), _group32(u)])  # type: ignore[arg-type]
        return _pack(fused, device)  # type: ignore[arg-type]
    return torch.cat([_float(g, dtype), _float(u, dtype)]).to(device).contiguous()


def as_matrix(w: Source, dtype: torch.dtype, device: torch.device) -> Matrix:
    """One expert matrix in the form its matmul reads. A float one is copied into memory of its
    own, never left a view into the checkpoint: MKL's float32 GEMM picks its kernel by address
    alignment, and an expert at an arbitrary offset of the file's map would compute last-bit
    differently from the same expert mapped back from the weight cache (64-byte aligned)."""
    d = _decoded(w)
    return _pack(d, device) if is_quantized(d) else d.to(device=device, dtype=dtype, copy=True).contiguous()  # type: ignore[arg-type]


def _group32(w: QuantizedWeight | SuperBlockWeight) -> QuantizedWeight:
    return w.to_group32() if isinstance(w, SuperBlockWeight) else w


class Experts(nn.Module):
    """E experts of one layer; `forward` runs each token through its routed experts, weighted."""

    def __init__(
        self,
        num_experts: int,
        hidden: int,
        intermediate: int,
        act: Activation,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        super().__init__()
        self.num_experts, self.hidden, self.intermediate = num_experts, hidden, intermediate
        self.act, self.bias, self.dtype, self.device = act, bias, dtype, torch.device(device)
        self.gate_up: list[Matrix | None] = []  # resident: per expert [2I, H], gate rows then up rows
        self.down: list[Matrix | None] = []  # resident: per expert [H, I]
        self.gate_up_bias: torch.Tensor | None = None  # [E, 2I]
        self.down_bias: torch.Tensor | None = None  # [E, H]
        # offload: the cache shared by all layers, this layer's key in it, and per expert its
        # backing (gate, up, down) sources, decoded on a miss
        self.cache: ExpertCache | None = None
        self.key = 0
        self.backing: list[tuple[Source, Source, Source]] = []
        self._grouped: bool | None = None  # `_grouped_kind`, decided at the first forward
        # expert parallelism (models.shard.split_experts): the experts this rank holds (entries of
        # gate_up / down for the others are None) and the collective over [P, H] float32 outputs
        self.local: range | None = None
        self.combine: Callable[[torch.Tensor], None] | None = None

    def held(self) -> range:
        """The experts this layer holds: all, or its rank's share under expert parallelism."""
        return range(self.num_experts) if self.local is None else self.local

    def resident(self) -> list[tuple[str, int, Matrix]]:
        """(`gate_up` | `down`, expert, matrix) of every resident matrix held here."""
        return [
            (kind, e, m)
            for kind, ms in (("gate_up", self.gate_up), ("down", self.down))
            for e, m in enumerate(ms)
            if m is not None
        ]

    def load(
        self,
        gate: ExpertStack,
        up: ExpertStack,
        down: ExpertStack,
        gate_bias: torch.Tensor | None = None,
        up_bias: torch.Tensor | None = None,
        down_bias: torch.Tensor | None = None,
    ) -> None:
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
        held = self.held()
        if self.cache is None:  # other ranks' experts are never decoded here
            self.gate_up = [
                fuse_gate_up(gate[e], up[e], self.dtype, self.device) if e in held else None for e in range(E)
            ]
            self.down = [as_matrix(down[e], self.dtype, self.device) if e in held else None for e in range(E)]
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
        w = self.gate_up[self.held().start]
        if isinstance(w, torch.Tensor):
            return str(self.dtype).removeprefix("torch.")
        return f"{w.format} (group 32)" if isinstance(w, PackedWeight) else w.format

    def _grouped_kind(self) -> bool:
        """Whether the step runs as two grouped kernel calls: resident experts, every gate_up one
        super-block kind and shape, every down likewise, and the kernel built."""
        if self.cache is not None or not self.gate_up or not grouped_matmul_available():
            return False
        held = self.held()
        return all(
            all(isinstance(ms[e], PackedSuperBlock) and ms[e].kind == ms[held.start].kind for e in held)  # type: ignore[union-attr]
            for ms in (self.gate_up, self.down)
        )

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [T, H], expert_ids [T, k] long, weights [T, k] -> sum_j weights[:, j] * expert_j(x) [T, H].

        The step's (token, expert) pairs ordered by expert, then token; each expert's rows through
        it (`_pair_outputs`), weighted, in float32; then each token's pairs summed in that order
        (ascending expert) and rounded once. Under expert parallelism this layer fills only the pairs
        of its own experts (a contiguous run of that order) and leaves the others zero; `combine`
        adds the ranks' arrays, which is exact (one non-zero term per value), before the sum, so
        every rank gets one rank's bits."""
        if self._grouped is None:
            self._grouped = self._grouped_kind()
        k = expert_ids.shape[1]
        flat = expert_ids.reshape(-1)  # [P = T k]
        order = flat.argsort(stable=True)  # [P] pairs by expert, then token
        by_expert = flat[order]
        tok = order // k  # [P]
        flat_weights = weights.reshape(-1)

        def weighted(pairs: slice) -> torch.Tensor:  # [n, H] float32: the pairs' weighted outputs
            y = self._pair_outputs(x.index_select(0, tok[pairs]), by_expert[pairs])
            return (y * flat_weights[order[pairs], None]).float()

        if self.local is None:
            contributions = (
                weighted(slice(0, flat.numel())) if flat.numel() else x.new_zeros(0, self.hidden, dtype=torch.float32)
            )
        else:
            bounds = torch.tensor([self.local.start, self.local.stop], dtype=by_expert.dtype, device=by_expert.device)
            lo, hi = torch.searchsorted(by_expert, bounds).tolist()
            contributions = torch.zeros(flat.numel(), self.hidden, dtype=torch.float32, device=x.device)  # [P, H]
            if hi > lo:
                contributions[lo:hi] = weighted(slice(lo, hi))
            if self.combine is not None:
                self.combine(contributions)
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)  # [T, H]
        out.index_add_(0, tok, contributions)
        return out.to(x.dtype)

    def _pair_outputs(self, rows: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """rows [n, H] routed to experts `ids` [n] (ascending) -> each row through its expert [n, H]:
        resident super-block experts as two grouped kernel calls (`_grouped`), others one call per
        expert. The grouped call takes each expert's rows in the same chunks as a call on them
        alone, so the two give the same bits."""
        I = self.intermediate
        active, counts = torch.unique_consecutive(ids, return_counts=True)
        offsets = F.pad(counts.cumsum(0), (1, 0))  # [A + 1]
        experts = active.tolist()
        if self._grouped:

            def project(a: torch.Tensor, mats: list, bias: torch.Tensor | None) -> torch.Tensor:
                if bias is None:
                    return grouped_matmul(a, offsets, mats)
                # the bias added in float32 before the output's rounding, as the per-expert kernel does
                return (grouped_matmul(a.float(), offsets, mats) + bias[ids].float()).to(a.dtype)

            gate_up = project(rows, [self.gate_up[e] for e in experts], self.gate_up_bias)
            return project(self.act(gate_up[:, :I], gate_up[:, I:]), [self.down[e] for e in experts], self.down_bias)
        out = []
        for e, a, b in zip(experts, offsets[:-1].tolist(), offsets[1:].tolist()):
            gate_up_w, down_w = self.matrices(e)
            gb = self.gate_up_bias[e] if self.gate_up_bias is not None else None
            db = self.down_bias[e] if self.down_bias is not None else None
            gate_up = matmul(rows[a:b], gate_up_w, gb)
            out.append(matmul(self.act(gate_up[:, :I], gate_up[:, I:]), down_w, db))
        return torch.cat(out)


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


def row_block(w: Source, start: int, stop: int) -> Source:
    """Rows start:stop of one expert matrix (the gate or up half of a fused one); a deferred
    matrix stays deferred (decoded, then cut, when the experts load it)."""
    if isinstance(w, Deferred):
        part = (stop - start, w.shape[1])
        return Deferred(part, w.nbytes * part[0] // w.shape[0], lambda: row_block(w.make(), start, stop))
    if isinstance(w, (QuantizedWeight, SuperBlockWeight)):
        return w.map_rows(lambda t: t[start:stop].contiguous())
    return w[start:stop]


def take_experts(
    tensors: dict[str, Weight], prefix: str, num_experts: int, intermediate: int, weights: str
) -> tuple[ExpertStack, ...]:
    """Pop one layer's experts out of `tensors` -> (gate [E, I, H], up, down [E, H, I]), `weights`
    applied. gate / up come as transformers' stacked `{prefix}gate_up_proj` [E, 2I, H] (gate rows
    first), as the GGUF loader's lists of E packed matrices `{prefix}gate_proj` / `{prefix}up_proj`
    (`weights.gguf.expert_stack`), or as the hub's per-expert `{prefix}{e}.gate_proj.weight`; down
    as `{prefix}down_proj` (a stack [E, H, I] or such a list) or per expert."""

    def per_expert(proj: str) -> list[Weight]:
        names = [f"{prefix}{e}.{proj}.weight" for e in range(num_experts)]
        missing = [n for n in names if n not in tensors]
        if missing:
            raise ModelLoadError(f"missing tensors: {prefix}{proj} (stacked) or {', '.join(missing[:3])}")
        return [tensors.pop(n) for n in names]

    if f"{prefix}gate_up_proj" in tensors:
        gate_up = tensors.pop(f"{prefix}gate_up_proj")
        if isinstance(gate_up, torch.Tensor):
            gate, up = gate_up[:, :intermediate], gate_up[:, intermediate:]  # [E, I, H] each
        else:  # the GGUF loader's packed fused matrices (Gemma 4): E x [2I, H]
            gate = [row_block(w, 0, intermediate) for w in gate_up]
            up = [row_block(w, intermediate, 2 * intermediate) for w in gate_up]
    elif f"{prefix}gate_proj" in tensors and f"{prefix}up_proj" in tensors:
        gate, up = tensors.pop(f"{prefix}gate_proj"), tensors.pop(f"{prefix}up_proj")
    else:
        gate, up = per_expert("gate_proj"), per_expert("up_proj")
    down = tensors.pop(f"{prefix}down_proj") if f"{prefix}down_proj" in tensors else per_expert("down_proj")
    return with_policy(gate, weights), with_policy(up, weights), with_policy(down, weights)  # type: ignore[arg-type]
