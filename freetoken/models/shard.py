"""Megatron-style tensor-parallel sharding of a model: which slice of each weight a rank holds,
and the collectives that put the ranks' partial results back together.

Owns the shard plan (heads, KV heads, MLP columns and vocabulary rows of one rank, and how the
block-closing projections are combined), slicing the checkpoint's HF-named tensors (float or
`QuantizedWeight`, before they are fused or packed; the experts also as MXFP4 blocks or the GGUF
loader's deferred per-expert lists) and the collectives installed on a loaded model.
Column-parallel: q/k/v, gate/up, the experts' gate_up. The projections that close a block
(o_proj, down, the experts' down) are combined one of two ways (`ShardPlan.row_parallel`):

- `sum` (float weights): row-parallel, each rank multiplies its input columns and an all-reduce
  adds the partial sums (a row-parallel bias is kept by rank 0 only, so the sum adds it once).
  The sum differs from the unsplit one by float32 rounding only, and that rounding stays small.
- `gather` (quantized weights; MoE experts excepted): the block's input columns are all-gathered,
  each rank multiplies the whole input by its share of the projection's output rows, and the
  outputs are all-gathered. Every output value is then the one-rank kernel's value bit for bit:
  the decode kernel rounds each activation group to int8 at the next layer, and a last-bit
  difference from a reordered sum moves some of those roundings by a whole step, which grows
  layer by layer to the size of the activation rounding itself (docs/scale-out.md, "Numerics").

A family says how it splits (`Family.tensor_parallel`, families/): by width as above
(SPLIT_WIDTH), with its experts whole (SPLIT_EXPERTS), or not at all (None: more than one rank is
refused). Whole experts (Qwen3-MoE's) are expert-parallel (`ShardPlan.expert_parallel`): each
rank holds E / N whole experts in their file's form (no slice cuts a super-block, however narrow
the experts), the router is replicated, and each rank computes the (token, expert) pairs routed to
its experts; an all-reduce of the per-pair outputs (zero for the other ranks' pairs, so exact)
precedes the per-token sum, which every rank then does in one rank's order (`split_experts`,
`models.experts.Experts.forward`).

The embedding and output head are vocab-parallel (all-reduce of rows that are zero on every rank
but one, so exact; all-gather of the logits). KV heads split across ranks, or are replicated
when there are fewer KV heads than ranks. Nothing here runs at world size 1: the model code has
no parallel branch of its own. It does not start processes or choose a backend
(`freetoken.distributed` does).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from freetoken.errors import ConfigError
from freetoken.families import family
from freetoken.families.base import SPLIT_EXPERTS, SPLIT_WIDTH
from freetoken.models.config import ModelConfig
from freetoken.models.experts import Experts, Source
from freetoken.models.linear import Linear, Weight
from freetoken.ops.quantized import GROUP, SUPER, QuantizedWeight, SuperBlockWeight, dequantize, is_quantized
from freetoken.weights.dequant import Deferred


# How the projections that close an attention or MLP block (o_proj, down_proj) are combined.
ROW_SUM = "sum"  # row-parallel: partial sums, all-reduced
ROW_GATHER = "gather"  # input all-gathered, output rows split, output all-gathered: exact


def row_parallel_for(tensors: Mapping[str, object], weights: str) -> str:
    """ROW_GATHER when any matrix will run quantized (the `--weights` policy quantizes, or `auto`
    keeps a quantized checkpoint matrix), else ROW_SUM. A quantized matrix runs through the decode
    kernel, whose int8 activation rounding turns a last-bit difference of an all-reduce into a
    whole rounding step (see the module docstring), so its model needs every value exact."""
    if weights in ("int8", "int4"):
        return ROW_GATHER
    if weights == "bf16":
        return ROW_SUM

    def quantized(value: object) -> bool:
        if isinstance(value, list):
            return any(quantized(v) for v in value)
        return is_quantized(value) or isinstance(value, Deferred)

    mxfp4 = any(name.endswith("_blocks") for name in tensors)
    return ROW_GATHER if mxfp4 or any(quantized(v) for v in tensors.values()) else ROW_SUM


@dataclass(frozen=True)
class ShardPlan:
    """What rank `rank` of `world` holds of a model with `config` (the whole model's)."""

    rank: int
    world: int
    config: ModelConfig
    row_parallel: str = "sum"  # ROW_SUM | ROW_GATHER: how o_proj and down_proj are combined

    @property
    def gathers_rows(self) -> bool:
        return self.row_parallel == ROW_GATHER

    @property
    def expert_parallel(self) -> bool:
        """Whether the experts are split whole between the ranks (the family's `tensor_parallel` is
        SPLIT_EXPERTS: Qwen3-MoE) rather than by width."""
        return split_of(self.config) == SPLIT_EXPERTS

    @property
    def experts(self) -> range:
        """The experts this rank holds under expert parallelism."""
        share = self.config.num_experts // self.world
        return range(self.rank * share, (self.rank + 1) * share)

    @property
    def hidden_rows(self) -> slice:
        """The output rows (hidden units) of o_proj / down_proj held here under ROW_GATHER."""
        share = self.config.hidden_size // self.world
        return slice(self.rank * share, (self.rank + 1) * share)

    @property
    def heads(self) -> int:
        return self.config.num_heads // self.world

    @property
    def kv_heads(self) -> int:
        """KV heads held here: a share, or one replicated head when ranks outnumber them."""
        return max(self.config.num_kv_heads // self.world, 1)

    @property
    def first_kv_head(self) -> int:
        # The KV head of this rank's first query head (with replication every query head of
        # the rank shares it: check_shardable requires world % num_kv_heads == 0).
        group = self.config.num_heads // self.config.num_kv_heads
        return (self.rank * self.heads) // group

    @property
    def intermediate(self) -> int:
        return self.config.intermediate_size // self.world

    @property
    def vocab_rows(self) -> int:
        """Rows of the embedding / head per rank; the last rank's tail past the vocabulary is zero."""
        return math.ceil(self.config.vocab_size / self.world)

    def local_config(self) -> ModelConfig:
        """The config one rank's modules are built from (its heads, MLP width and vocab rows)."""
        return dataclasses.replace(
            self.config,
            num_heads=self.heads,
            num_kv_heads=self.kv_heads,
            intermediate_size=self.intermediate,
            vocab_size=self.vocab_rows,
        )


def split_of(config: ModelConfig) -> str | None:
    """How the model's family is split over ranks (`Family.tensor_parallel`: SPLIT_WIDTH,
    SPLIT_EXPERTS, or None where it has no shard plan here); SPLIT_WIDTH for an architecture no
    family names."""
    fam = family(config.architecture)
    return SPLIT_WIDTH if fam is None else fam.tensor_parallel


def check_shardable(config: ModelConfig, world: int, row_parallel: str = ROW_SUM) -> None:
    """Raise ConfigError (one line naming the flag) when `world` ranks cannot split `config`
    (under ROW_GATHER the hidden size too: the closing projections split their output rows)."""
    c, flag = config, f"--tensor-parallel-size {world}"
    if world < 1:
        raise ConfigError(f"--tensor-parallel-size must be at least 1, got {world}")
    split = split_of(c)
    if world > 1 and split is None:
        raise ConfigError(f"{flag} is not supported for {c.architecture} models")
    if world > 1 and split == SPLIT_EXPERTS and c.num_experts % world:
        raise ConfigError(f"{flag} does not divide the model's {c.num_experts} experts")
    if c.num_heads % world:
        raise ConfigError(f"{flag} does not divide the model's {c.num_heads} attention heads")
    if c.num_kv_heads % world and world % c.num_kv_heads:
        raise ConfigError(f"{flag} neither divides nor is a multiple of the model's {c.num_kv_heads} KV heads")
    if c.intermediate_size % world:
        raise ConfigError(f"{flag} does not divide the model's MLP width {c.intermediate_size}")
    if row_parallel == ROW_GATHER and c.hidden_size % world:
        raise ConfigError(f"{flag} does not divide the model's hidden size {c.hidden_size}")


# -- slicing checkpoint tensors ---------------------------------------------------------------


def _rows(w: Weight, start: int, stop: int) -> Weight:
    if isinstance(w, (QuantizedWeight, SuperBlockWeight)):
        return w.map_rows(lambda t: t[start:stop].contiguous())
    return w[start:stop].contiguous()


def _cols(w: Weight, start: int, stop: int) -> Weight:
    """Columns [start, stop) of a matrix; a quantized one keeps whole groups (32, or a K-quant's
    super-blocks of 256), else it is dequantized first (a slice that cuts one cannot stay whole)."""
    if isinstance(w, (QuantizedWeight, SuperBlockWeight)):
        quantum = SUPER if isinstance(w, SuperBlockWeight) else GROUP
        if start % quantum or stop % quantum:
            return dequantize(w, torch.float32)[:, start:stop].contiguous()
        return w.cols(start, stop)
    return w[:, start:stop].contiguous()


def _padded_rows(w: Weight, start: int, rows: int) -> Weight:
    """Rows [start, start + rows) of a vocab table, zero past its end (so every rank's shard,
    and so every all-gathered piece, has the same size)."""
    part = _rows(w, start, min(start + rows, w.shape[0]))
    missing = rows - part.shape[0]
    if missing == 0:
        return part

    def pad(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t, t.new_zeros(missing, *t.shape[1:])])

    if isinstance(part, (QuantizedWeight, SuperBlockWeight)):  # zero integers and scales dequantize to zero rows
        return part.map_rows(pad)
    return pad(part)


def _zero(w: Weight) -> Weight:
    return torch.zeros_like(dequantize(w, torch.float32) if is_quantized(w) else w)


def shard_tensor(name: str, w: Weight, plan: ShardPlan) -> Weight:
    """This rank's part of the checkpoint tensor `name` (HF naming); replicated tensors pass as they are."""
    c, r = plan.config, plan.rank
    D = c.head_dim
    module, _, leaf = name.rpartition(".")
    proj = module.rpartition(".")[2]
    heads = slice(r * plan.heads, (r + 1) * plan.heads)
    inter = slice(r * plan.intermediate, (r + 1) * plan.intermediate)
    if plan.expert_parallel and ".experts." in f"{name}.":  # whole experts: split_experts picks this rank's
        return w
    if proj == "q_proj":
        return _rows(w, heads.start * D, heads.stop * D)
    if proj in ("k_proj", "v_proj"):
        first = plan.first_kv_head
        return _rows(w, first * D, (first + plan.kv_heads) * D)
    if proj in ("gate_proj", "up_proj"):
        return _rows(w, inter.start, inter.stop)
    if proj in ("o_proj", "down_proj") and plan.gathers_rows:  # output rows (+ bias): whole input
        return _rows(w, plan.hidden_rows.start, plan.hidden_rows.stop)
    if proj in ("o_proj", "down_proj") and leaf == "weight":
        span = heads if proj == "o_proj" else inter
        scale = D if proj == "o_proj" else 1
        return _cols(w, span.start * scale, span.stop * scale)
    if proj in ("o_proj", "down_proj") and leaf == "bias":
        return w if r == 0 else _zero(w)  # added once, by rank 0, before the sum
    if leaf == "sinks":
        return w[heads].contiguous()
    if proj == "experts" and isinstance(w, list):  # the GGUF loader's E matrices [out, in] (may be deferred)
        if leaf in ("gate_proj", "up_proj"):
            return [_expert_part(m, lambda m: _rows(m, inter.start, inter.stop), plan.world, 0) for m in w]
        if leaf == "down_proj":
            return [_expert_part(m, lambda m: _cols(m, inter.start, inter.stop), plan.world, 1) for m in w]
    if proj == "experts" and leaf.endswith(("_blocks", "_scales")):  # gpt-oss MXFP4: [E, out, in / 32, (16)]
        if leaf.startswith("gate_up_proj"):
            return w[:, 2 * inter.start : 2 * inter.stop].contiguous()  # rows (gate, up) in pairs
        if inter.start % GROUP or inter.stop % GROUP:
            raise ConfigError(f"--tensor-parallel-size {plan.world} splits MXFP4 expert blocks of {GROUP}")
        return w[:, :, inter.start // GROUP : inter.stop // GROUP].contiguous()
    if proj == "experts":  # gpt-oss: [E, h, 2i] gate/up interleaved, [E, i, h] down
        if leaf in ("gate_up_proj", "gate_up_proj_bias"):
            return w[..., 2 * inter.start : 2 * inter.stop].contiguous()  # pairs (gate, up) stay together
        if leaf == "down_proj":
            return w[:, inter].contiguous()
        if leaf == "down_proj_bias":
            return w if r == 0 else _zero(w)
    if proj in ("embed_tokens", "lm_head"):
        return _padded_rows(w, r * plan.vocab_rows, plan.vocab_rows)
    return w


def _expert_part(m: Source, part: Callable[[Weight], Weight], world: int, dim: int) -> Source:
    """`part` of one expert matrix; of a deferred one, when it is decoded (1/world of `dim`)."""
    if isinstance(m, Deferred):
        shape = (m.shape[0] // world, m.shape[1]) if dim == 0 else (m.shape[0], m.shape[1] // world)
        return Deferred(shape, m.nbytes // world, lambda: part(m.make()))
    return part(m)


def shard_tensors(tensors: Mapping[str, Weight], plan: ShardPlan) -> dict[str, Weight]:
    return {name: shard_tensor(name, w, plan) for name, w in tensors.items()}


# -- collectives on a loaded model ------------------------------------------------------------


def _sum_output(_module: nn.Module, _args: object, out: torch.Tensor) -> torch.Tensor:
    """Forward hook of a block whose last projection is row-parallel: the ranks' partial sums."""
    dist.all_reduce(out)
    return out


def _all_gather_columns(local: torch.Tensor, vocab: int) -> torch.Tensor:
    """[N, V / world] per rank -> [N, vocab] on every rank, shards in rank order."""
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, local.contiguous())
    return torch.cat(parts, dim=-1)[:, :vocab]  # [N, vocab]


class GatheredRowLinear(Linear):
    """A block's closing projection under ROW_GATHER: this rank's output rows [hidden / N, in] of
    the whole matrix. x [T, in / N] (this rank's heads or MLP columns) -> [T, hidden]: the input
    columns all-gathered, multiplied, the output columns all-gathered (shards in rank order)."""

    def __init__(self, local: Linear, plan: ShardPlan) -> None:
        n_out, n_in = local.weight.shape  # type: ignore[union-attr]
        super().__init__(
            n_in * plan.world,
            n_out // plan.world,
            local.bias is not None,
            local.dtype,
            local.weight.device,
            local.quantizable,
        )  # type: ignore[union-attr]
        self.gathered_in = n_in * plan.world
        self.gathered_out = n_out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        whole = _all_gather_columns(x, self.gathered_in)  # [T, in]
        return _all_gather_columns(self.project(whole, self.bias), self.gathered_out)  # [T, hidden]


def gather_row_projections(model: nn.Module, plan: ShardPlan) -> None:
    """Under ROW_GATHER, swap every dense o_proj / down_proj Linear of a model built from
    `plan.local_config()` for a GatheredRowLinear of the right shape, before its weights load
    (MoE experts keep their row-parallel sum)."""
    if not plan.gathers_rows:
        return
    for layer in model.layers:  # type: ignore[attr-defined]
        for block, proj in ((layer.self_attn, "o_proj"), (layer.mlp, "down_proj")):
            local = getattr(block, proj, None)
            if isinstance(local, Linear) and not isinstance(local, GatheredRowLinear):
                setattr(block, proj, GatheredRowLinear(local, plan))


def split_experts(model: nn.Module, plan: ShardPlan) -> None:
    """Under expert parallelism, tell every Experts layer which experts it holds (before its
    weights load, so that only those are decoded) and how the ranks' per-pair outputs combine."""
    if not plan.expert_parallel:
        return
    for module in model.modules():
        if isinstance(module, Experts):
            module.local = plan.experts
            module.combine = dist.all_reduce


def _expert_parallel(block: nn.Module) -> bool:
    """Whether the block's experts combine their own outputs (split_experts): no sum after it."""
    return any(isinstance(m, Experts) and m.local is not None for m in block.modules())


def _closes_with_gather(block: nn.Module) -> bool:
    return isinstance(getattr(block, "o_proj", None) or getattr(block, "down_proj", None), GatheredRowLinear)


class VocabParallelEmbedding(nn.Module):
    """Rows [first, first + rows) of the token table on this rank: tokens outside them read zero,
    and the sum over ranks is the full lookup. `project` is the tied, vocab-parallel output head."""

    def __init__(self, local: nn.Module, plan: ShardPlan) -> None:
        super().__init__()
        self.local = local
        self.first = plan.rank * plan.vocab_rows
        self.rows = plan.vocab_rows
        self.vocab = plan.config.vocab_size

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [T] -> [T, hidden], summed over ranks."""
        mine = (ids >= self.first) & (ids < self.first + self.rows)  # [T]
        x = self.local((ids - self.first).clamp(0, self.rows - 1))  # [T, hidden]
        x = x * mine[:, None].to(x.dtype)
        dist.all_reduce(x)
        return x

    def project(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [N, hidden] -> logits [N, vocab], each rank's columns gathered."""
        return _all_gather_columns(self.local.project(x, bias), self.vocab)


class VocabParallelHead(nn.Module):
    """An untied output head over this rank's vocab rows; logits gathered across ranks."""

    def __init__(self, local: nn.Module, plan: ShardPlan) -> None:
        super().__init__()
        self.local = local
        self.vocab = plan.config.vocab_size

    def project(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return _all_gather_columns(self.local.project(x, bias), self.vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.project(x)


def install_collectives(model: nn.Module, plan: ShardPlan) -> None:
    """Make a model built from `plan.local_config()` and loaded with `shard_tensors` compute the
    whole model's function: a sum after every attention and MLP block whose closing projection
    is row-parallel (a GatheredRowLinear already returns the whole output), vocab-parallel ends."""
    for layer in model.layers:  # type: ignore[attr-defined]
        for block in (layer.self_attn, layer.mlp):
            if not (_closes_with_gather(block) or _expert_parallel(block)):
                block.register_forward_hook(_sum_output)
    model.embed_tokens = VocabParallelEmbedding(model.embed_tokens, plan)  # type: ignore[assignment]
    if model.lm_head is not None:  # type: ignore[attr-defined]
        model.lm_head = VocabParallelHead(model.lm_head, plan)  # type: ignore[assignment]
