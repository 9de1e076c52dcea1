"""GGUF tensor names and layouts -> Hugging Face transformers names and layouts.

Owns the generic part of turning a GGUF file's tensors into an HF state dict: the global names
(embedding, final norm, output), the tensors HF has no parameter for, the joining of an expert's
separate gate / up stacks, and the torch code of each named rearrangement. What differs per
architecture comes from its family (`freetoken.families`, `FAMILY.gguf`): the table from a layer
tensor's name after `blk.N.` to HF's after `model.layers.N.`, which rearrangement a tensor needs
(`layout`: llama.cpp's rotary row permutation of q/k undone, Gemma's `w + 1` norms shifted back,
ggml's [E, out, in] experts transposed) and how the gate / up halves join (`experts_join`: on the
rows, gate first, or interleaved on the last axis, gate at even indices).

A file without `output.weight` has tied embeddings: no `lm_head.weight` is produced, and the
config says `tie_word_embeddings`. Matrices kept quantized (`add_quantized`) get the same row
rearrangement; one whose columns move is kept as stored, its column order recorded. This module does not read files or dequantize, and holds no family's knowledge.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from freetoken.errors import ModelLoadError
from freetoken.families import gguf_facts
from freetoken.families.base import (
    A_LOG,
    CONV_KERNEL,
    EXPERTS_TRANSPOSE,
    INTERLEAVE,
    LINEAR_A_LOG,
    LINEAR_CONV,
    LINEAR_QKV_ROWS,
    LINEAR_V_COLUMNS,
    LINEAR_V_ROWS,
    LINEAR_V_SCALARS,
    NORM_MINUS_ONE,
    ONE_ROW,
    UNPERMUTE_K_ROWS,
    UNPERMUTE_Q_ROWS,
)
from freetoken.ops.quantized import ColumnOrderedWeight, Quantized, QuantizedWeight, SuperBlockWeight

_GLOBAL: dict[str, str] = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

# Tensors llama.cpp writes that have no HF parameter: Llama 3 rope frequency factors (HF derives
# them from the rope config) and the unused rotary table of old conversions.
_IGNORED: frozenset[str] = frozenset({"rope_freqs.weight"})
_IGNORED_IN_LAYER: frozenset[str] = frozenset({"attn_rot_embd.weight"})

# Expert halves: which half of gate_up_proj(_bias) a tensor fills (0 = gate, 1 = up).
_GATE_UP_PART: dict[str, int] = {"ffn_gate_exps": 0, "ffn_up_exps": 1}


@dataclass(frozen=True)
class Target:
    """Where a GGUF tensor goes: an HF parameter, or one half of one (`part` 0 = gate, 1 = up,
    joined as the family's `experts_join` says)."""

    hf_name: str
    part: int | None = None


def hf_target(arch: str, gguf_name: str) -> Target | None:
    """The HF destination of a GGUF tensor; None for a tensor HF has no parameter for.

    Raises ModelLoadError for an architecture or a tensor name this module does not know.
    """
    table = gguf_facts(arch).tensors
    if gguf_name in _GLOBAL:
        return Target(_GLOBAL[gguf_name])
    if gguf_name in _IGNORED:
        return None
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit():
        rest = parts[2]
        if rest in _IGNORED_IN_LAYER:
            return None
        hf_rest = table.get(rest)
        if hf_rest is not None:
            part = _GATE_UP_PART.get(rest.rsplit(".", 1)[0])
            return Target(f"model.layers.{parts[1]}.{hf_rest}", part)
    raise ModelLoadError(f"{arch} GGUF file has an unexpected tensor {gguf_name}")


def unpermute_rotary_rows(t: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's row permutation of a Llama q/k projection (weight [rows, in] or bias).

    llama.cpp turned each head's rows (first half, second half) into interleaved pairs; row
    `2j + s` of a head came from HF row `s * (d / 2) + j`.
    """
    rows = t.shape[0]
    if rows % (2 * n_heads) != 0:
        raise ModelLoadError(f"q/k projection with {rows} rows cannot be split into {n_heads} rotary heads")
    half = rows // n_heads // 2
    # [heads, half, 2, ...] -> [heads, 2, half, ...]
    return t.reshape(n_heads, half, 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)


# (key heads, value heads, key head dim, value head dim) of a hybrid model's linear-attention layers
LinearShape = tuple[int, int, int, int]

# the rearrangements that move columns: a matrix needing one stays in integer rows as stored,
# its column order recorded (ColumnOrderedWeight)
_COLUMN_LAYOUTS = frozenset({LINEAR_V_COLUMNS})


def _grouped(t: torch.Tensor, dim: int, linear: LinearShape | None, d: int) -> torch.Tensor:
    """Value heads along `dim` (d channels each) from the converter's tiled order (head j of key
    group g at j * hk + g) back to HF's grouped order (g * (hv / hk) + j)."""
    if linear is None or linear[0] == linear[1]:
        return t
    hk, hv = linear[0], linear[1]
    shape = list(t.shape)
    t = t.reshape(*shape[:dim], hv // hk, hk, d, *shape[dim + 1 :])
    return t.transpose(dim, dim + 1).reshape(shape)


def _linear_qkv(t: torch.Tensor, linear: LinearShape | None) -> torch.Tensor:
    """q and k rows as they are, the v rows regrouped."""
    if linear is None:
        return t
    qk = 2 * linear[0] * linear[2]
    return torch.cat([t[:qk], _grouped(t[qk:], 0, linear, linear[3])])


def _to_hf_layout(
    layout: str | None, t: torch.Tensor, n_heads: int, n_kv_heads: int, linear: LinearShape | None = None
) -> torch.Tensor:
    """Rearrange the values of one tensor into HF's layout by the rearrangement its family names."""
    if layout is None:
        return t
    if layout == UNPERMUTE_Q_ROWS:
        return unpermute_rotary_rows(t, n_heads)
    if layout == UNPERMUTE_K_ROWS:
        return unpermute_rotary_rows(t, n_kv_heads)
    if layout == NORM_MINUS_ONE:
        return t - 1
    if layout == EXPERTS_TRANSPOSE:
        return t.transpose(-1, -2)  # ggml [E, out, in] -> HF [E, in, out]
    if layout == ONE_ROW:
        return t.reshape(1, -1)
    if layout == A_LOG:
        return torch.log(-t)
    if layout == CONV_KERNEL:
        return t[:, None, :]  # [C, K] -> [C, 1, K]
    dv = linear[3] if linear is not None else 1
    if layout == LINEAR_QKV_ROWS:
        return _linear_qkv(t, linear)
    if layout == LINEAR_CONV:
        return _linear_qkv(t, linear)[:, None, :]  # [C, K] -> [C, 1, K]
    if layout == LINEAR_V_ROWS:
        return _grouped(t, 0, linear, dv)
    if layout == LINEAR_V_SCALARS:
        return _grouped(t, 0, linear, 1)
    if layout == LINEAR_A_LOG:
        return _grouped(torch.log(-t), 0, linear, 1)
    if layout == LINEAR_V_COLUMNS:
        return _grouped(t, 1, linear, dv)
    raise ModelLoadError(f"unknown tensor layout {layout!r}")


def _interleave(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """[..., I] gate and up -> [..., 2I] with gate at even and up at odd indices."""
    if gate.shape != up.shape:
        raise ModelLoadError(f"expert gate {list(gate.shape)} and up {list(up.shape)} shapes differ")
    return torch.stack((gate, up), dim=-1).reshape(*gate.shape[:-1], 2 * gate.shape[-1])


class HFTensorAssembler:
    """Collects GGUF tensors one at a time and hands back the HF state dict.

    Tensors are renamed and rearranged as they arrive (in the precision they come in, so the
    Gemma norm shift is exact), then stored in `dtype`; the gate and up halves of experts stored
    as separate stacks wait here until both are present.
    """

    def __init__(
        self,
        arch: str,
        num_attention_heads: int,
        num_key_value_heads: int,
        dtype: torch.dtype = torch.float32,
        linear: LinearShape | None = None,
    ) -> None:
        self.facts = gguf_facts(arch)
        self.linear = linear  # a hybrid model's linear-attention layers (LINEAR_* rearrangements)
        self.arch = arch
        self.dtype = dtype
        self.n_heads = num_attention_heads
        self.n_kv_heads = num_key_value_heads
        self.tensors: dict[str, torch.Tensor | QuantizedWeight | SuperBlockWeight] = {}
        self._halves: dict[str, dict[int, torch.Tensor]] = {}

    def add(self, gguf_name: str, tensor: torch.Tensor) -> None:
        target = hf_target(self.arch, gguf_name)
        if target is None:
            return
        rest = gguf_name.split(".", 2)[2] if gguf_name.startswith("blk.") else gguf_name
        t = _to_hf_layout(self.facts.layout(rest), tensor, self.n_heads, self.n_kv_heads, self.linear)
        interleave = self.facts.experts_join == INTERLEAVE
        if rest.startswith("ffn_gate_up_exps.") and interleave:
            # fused [.., 2I] halves (gate first) -> interleaved
            gate, up = t.chunk(2, dim=-1)
            t = _interleave(gate, up)
        if target.part is None:
            self._put(target.hf_name, t, gguf_name)
            return
        halves = self._halves.setdefault(target.hf_name, {})
        if target.part in halves:
            raise ModelLoadError(f"GGUF file holds {gguf_name} twice")
        halves[target.part] = t
        if len(halves) == 2:
            del self._halves[target.hf_name]
            joined = _interleave(halves[0], halves[1]) if interleave else torch.cat((halves[0], halves[1]), dim=-2)
            self._put(target.hf_name, joined, gguf_name)

    def add_quantized(self, gguf_name: str, qw: QuantizedWeight | SuperBlockWeight) -> None:
        """A matrix kept in integer form: renamed, and its rows rearranged as `add` would."""
        target = hf_target(self.arch, gguf_name)
        if target is None:
            return
        if target.part is not None:
            raise ModelLoadError(f"{gguf_name}: an expert half cannot stay quantized")
        rest = gguf_name.split(".", 2)[2] if gguf_name.startswith("blk.") else gguf_name
        layout = self.facts.layout(rest)

        def rows(t: torch.Tensor) -> torch.Tensor:
            return _to_hf_layout(layout, t, self.n_heads, self.n_kv_heads, self.linear).contiguous()

        if layout == NORM_MINUS_ONE:
            raise ModelLoadError(f"{gguf_name}: a norm cannot stay quantized")
        if target.hf_name in self.tensors:
            raise ModelLoadError(f"GGUF file holds {gguf_name} twice")
        if layout in _COLUMN_LAYOUTS:
            self.tensors[target.hf_name] = self._column_ordered(layout, qw)
            return
        self.tensors[target.hf_name] = qw.map_rows(rows)

    def _column_ordered(self, layout: str, qw: QuantizedWeight | SuperBlockWeight) -> Quantized:
        """A matrix whose columns the layout moves, kept as stored with the order of its columns
        (moving them would cut its blocks): stored column c is HF input order[c]."""
        k = qw.shape[1]
        hf_to_stored = _to_hf_layout(layout, torch.arange(k)[None], self.n_heads, self.n_kv_heads, self.linear)[0]
        if torch.equal(hf_to_stored, torch.arange(k)):
            return qw  # as many key heads as value heads: nothing moves
        return ColumnOrderedWeight(qw, torch.argsort(hf_to_stored))

    def keeps_float32(self, gguf_name: str) -> bool:
        """Whether the tensor reaches the model in float32 although `dtype` is a half type (the
        family's `float32`: a router the model holds in float32 gets the file's values, not
        values rounded to the half type on the way)."""
        rest = gguf_name.split(".", 2)[2] if gguf_name.startswith("blk.") else gguf_name
        return self.dtype in (torch.bfloat16, torch.float16) and rest in self.facts.float32

    def _put(self, hf_name: str, t: torch.Tensor, gguf_name: str) -> None:
        if hf_name in self.tensors:
            raise ModelLoadError(f"GGUF file holds {gguf_name} twice")
        dtype = torch.float32 if self.keeps_float32(gguf_name) else self.dtype
        self.tensors[hf_name] = t.to(dtype).contiguous()

    def finish(self) -> dict[str, torch.Tensor | QuantizedWeight]:
        """The HF state dict; raises ModelLoadError when an expert half never arrived."""
        if self._halves:
            missing = ", ".join(sorted(self._halves))
            raise ModelLoadError(f"GGUF file has only one of the gate / up expert tensors for {missing}")
        return self.tensors
