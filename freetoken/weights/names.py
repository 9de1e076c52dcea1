"""GGUF tensor names and layouts -> Hugging Face transformers names and layouts.

Owns, for the architectures FreeToken runs from GGUF files (`llama`, `gemma3`, `gpt-oss`,
`qwen3`, `qwen3moe`, `gemma4`), which HF parameter each GGUF tensor becomes and how its values are
rearranged on the way:

- llama: llama.cpp's converter permutes the rows of q_proj / k_proj (per head, from HF's
  "first half / second half" rotary layout to interleaved pairs); we undo that permutation.
- gemma3: llama.cpp stores every RMSNorm weight as `w + 1` (Gemma's norm multiplies by `1 + w`);
  we subtract 1 so the tensors mean what HF's Gemma3RMSNorm expects.
- gpt-oss: experts are stored as separate gate / up / down stacks in ggml's [out, in] layout; HF
  keeps `gate_up_proj` [E, H, 2I] with gate and up interleaved on the last axis (gate at even
  indices), `down_proj` [E, I, H], and the biases alike.
- qwen3 / qwen3moe / gemma4: no row permutation (llama.cpp ropes them NEOX-style, as HF) and no
  norm shift (Gemma 4's norms multiply by w). Experts keep ggml's [E, out, in] = HF's layout;
  qwen3moe's separate gate / up stacks join as HF's `gate_up_proj` [E, 2I, H], gate rows first
  (gemma4 files hold it fused already). Gemma 4's router scale and per-expert scale are stored as
  `ffn_gate_inp.scale` and `ffn_down_exps.scale`, its `layer_scalar` as `layer_output_scale`.

- qwen35 / qwen35moe (Qwen3.5): the (1 + w) norms are stored as `1 + w` (the linear layers'
  gated `ssm_norm`, which multiplies by w, as it is): 1 is subtracted; `ssm_a` holds -exp(A_log);
  the conv kernel is stored [C, K] (HF [C, 1, K]); where key heads are fewer than value heads, the
  converter reorders the value heads from grouped by key head to tiled (v rows of `attn_qkv`,
  `attn_gate`, `ssm_alpha` / `ssm_beta` rows, `ssm_a`, `ssm_dt`, the conv's v channels,
  `ssm_out` columns): the order is restored.

A file without `output.weight` has tied embeddings: no `lm_head.weight` is produced, and the
config says `tie_word_embeddings`. Matrices kept quantized (`add_quantized`) get the same row
rearrangement. This module does not read files or dequantize.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from freetoken.errors import ModelLoadError
from freetoken.ops.quantized import QuantizedWeight, SuperBlockWeight
from freetoken.weights.architectures import check_architecture


_GLOBAL: dict[str, str] = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

_ATTENTION: dict[str, str] = {
    f"attn_{g}.{kind}": f"self_attn.{h}_proj.{kind}"
    for g, h in (("q", "q"), ("k", "k"), ("v", "v"), ("output", "o"))
    for kind in ("weight", "bias")
}

_DENSE_MLP: dict[str, str] = {
    f"ffn_{p}.{kind}": f"mlp.{p}_proj.{kind}" for p in ("gate", "up", "down") for kind in ("weight", "bias")
}

_LAYER: dict[str, dict[str, str]] = {
    "llama": {
        **_ATTENTION,
        **_DENSE_MLP,
        "attn_norm.weight": "input_layernorm.weight",
        "ffn_norm.weight": "post_attention_layernorm.weight",
    },
    "gemma3": {
        **_ATTENTION,
        **_DENSE_MLP,
        "attn_norm.weight": "input_layernorm.weight",
        "post_attention_norm.weight": "post_attention_layernorm.weight",
        "ffn_norm.weight": "pre_feedforward_layernorm.weight",
        "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
        "attn_q_norm.weight": "self_attn.q_norm.weight",
        "attn_k_norm.weight": "self_attn.k_norm.weight",
    },
    "gpt-oss": {
        **_ATTENTION,
        "attn_norm.weight": "input_layernorm.weight",
        "post_attention_norm.weight": "post_attention_layernorm.weight",
        "attn_sinks.weight": "self_attn.sinks",
        "ffn_gate_inp.weight": "mlp.router.weight",
        "ffn_gate_inp.bias": "mlp.router.bias",
        "ffn_down_exps.weight": "mlp.experts.down_proj",
        "ffn_down_exps.bias": "mlp.experts.down_proj_bias",
        "ffn_gate_exps.weight": "mlp.experts.gate_up_proj",
        "ffn_up_exps.weight": "mlp.experts.gate_up_proj",
        "ffn_gate_up_exps.weight": "mlp.experts.gate_up_proj",
        "ffn_gate_exps.bias": "mlp.experts.gate_up_proj_bias",
        "ffn_up_exps.bias": "mlp.experts.gate_up_proj_bias",
        "ffn_gate_up_exps.bias": "mlp.experts.gate_up_proj_bias",
    },
}

_QWEN3: dict[str, str] = {
    **_ATTENTION,
    **_DENSE_MLP,
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}
_LAYER["qwen3"] = _QWEN3
_LAYER["qwen2"] = _LAYER["llama"]  # the same names (the q/k/v biases included); rows not permuted
_LAYER["qwen3moe"] = {
    **_QWEN3,
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_exps.weight": "mlp.experts.gate_up_proj",
    "ffn_up_exps.weight": "mlp.experts.gate_up_proj",
    "ffn_down_exps.weight": "mlp.experts.down_proj",
}
_LAYER["gemma4"] = {
    **_LAYER["gemma3"],
    "pre_ffw_norm_2.weight": "pre_feedforward_layernorm_2.weight",
    "post_ffw_norm_1.weight": "post_feedforward_layernorm_1.weight",
    "post_ffw_norm_2.weight": "post_feedforward_layernorm_2.weight",
    "layer_output_scale.weight": "layer_scalar",
    "ffn_gate_inp.weight": "router.proj.weight",
    "ffn_gate_inp.scale": "router.scale",
    "ffn_down_exps.scale": "router.per_expert_scale",
    "ffn_gate_up_exps.weight": "experts.gate_up_proj",
    "ffn_gate_exps.weight": "experts.gate_up_proj",
    "ffn_up_exps.weight": "experts.gate_up_proj",
    "ffn_down_exps.weight": "experts.down_proj",
}
_LAYER["qwen35"] = {
    **_QWEN3,
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ssm_a": "linear_attn.A_log",
    "ssm_conv1d.weight": "linear_attn.conv1d.weight",
    "ssm_dt.bias": "linear_attn.dt_bias",
    "ssm_alpha.weight": "linear_attn.in_proj_a.weight",
    "ssm_beta.weight": "linear_attn.in_proj_b.weight",
    "attn_qkv.weight": "linear_attn.in_proj_qkv.weight",
    "attn_gate.weight": "linear_attn.in_proj_z.weight",
    "ssm_norm.weight": "linear_attn.norm.weight",
    "ssm_out.weight": "linear_attn.out_proj.weight",
}
_LAYER["qwen35moe"] = {
    **_LAYER["qwen35"],
    **{k: v for k, v in _LAYER["qwen3moe"].items() if k.startswith("ffn_") and "exps" in k or "gate_inp" in k},
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
}
# Architectures whose separate expert gate / up stacks join along the rows (gate first) rather
# than interleave on the last axis (gpt-oss).
_ROW_JOINED = frozenset({"qwen3moe", "gemma4", "qwen35moe"})
_QWEN35 = frozenset({"qwen35", "qwen35moe"})

# Tensors llama.cpp writes that have no HF parameter: Llama 3 rope frequency factors (HF derives
# them from the rope config) and the unused rotary table of old conversions.
_IGNORED: frozenset[str] = frozenset({"rope_freqs.weight"})
_IGNORED_IN_LAYER: frozenset[str] = frozenset({"attn_rot_embd.weight"})

# gpt-oss expert halves: which interleaved slot of gate_up_proj(_bias) a tensor fills.
_GATE_UP_PART: dict[str, int] = {"ffn_gate_exps": 0, "ffn_up_exps": 1}


@dataclass(frozen=True)
class Target:
    """Where a GGUF tensor goes: an HF parameter, or one half of one (`part` 0 = gate, 1 = up:
    interleaved on the last axis for gpt-oss, gate rows then up rows for `_ROW_JOINED`)."""

    hf_name: str
    part: int | None = None


def hf_target(arch: str, gguf_name: str) -> Target | None:
    """The HF destination of a GGUF tensor; None for a tensor HF has no parameter for.

    Raises ModelLoadError for an architecture or a tensor name this module does not know.
    """
    check_architecture(arch)
    if gguf_name in _GLOBAL:
        return Target(_GLOBAL[gguf_name])
    if gguf_name in _IGNORED:
        return None
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit():
        rest = parts[2]
        if rest in _IGNORED_IN_LAYER:
            return None
        hf_rest = _LAYER[arch].get(rest)
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


def _grouped(t: torch.Tensor, dim: int, hk: int, hv: int, d: int) -> torch.Tensor:
    """Value heads along `dim` (d channels each) from the converter's tiled order (head j of key
    group g at j * hk + g) back to HF's grouped order (g * (hv / hk) + j)."""
    shape = list(t.shape)
    per = hv // hk
    t = t.reshape(*shape[:dim], per, hk, d, *shape[dim + 1 :])
    return t.transpose(dim, dim + 1).reshape(shape)


def _qwen35_layout(rest: str, t: torch.Tensor, linear: tuple[int, int, int, int] | None) -> torch.Tensor:
    """One Qwen3.5 layer tensor into HF's layout; `linear` = (key heads, value heads, key dim,
    value dim) of the linear layers."""
    if rest.endswith("norm.weight") and rest != "ssm_norm.weight":
        t = t - 1
    if rest == "ssm_a":
        t = torch.log(-t)
    if linear is None or linear[0] == linear[1] or not rest.startswith(("attn_qkv", "attn_gate", "ssm_")):
        return t[:, None, :] if rest == "ssm_conv1d.weight" else t
    hk, hv, dk, dv = linear
    if rest in ("attn_qkv.weight", "ssm_conv1d.weight"):
        qk = 2 * hk * dk
        t = torch.cat([t[:qk], _grouped(t[qk:], 0, hk, hv, dv)])
    elif rest == "attn_gate.weight":
        t = _grouped(t, 0, hk, hv, dv)
    elif rest in ("ssm_alpha.weight", "ssm_beta.weight", "ssm_a", "ssm_dt.bias"):
        t = _grouped(t, 0, hk, hv, 1)
    elif rest == "ssm_out.weight":
        t = _grouped(t, 1, hk, hv, dv)
    return t[:, None, :] if rest == "ssm_conv1d.weight" else t


def _to_hf_layout(
    arch: str,
    rest: str,
    t: torch.Tensor,
    n_heads: int,
    n_kv_heads: int,
    linear: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:
    """Rearrange the values of one layer tensor (`rest` = name after `blk.N.`) into HF's layout."""
    if arch in _QWEN35:
        return _qwen35_layout(rest, t, linear)
    if arch == "llama":
        if rest.startswith("attn_q."):
            return unpermute_rotary_rows(t, n_heads)
        if rest.startswith("attn_k."):
            return unpermute_rotary_rows(t, n_kv_heads)
    elif arch == "gemma3":
        if rest.endswith("norm.weight"):
            return t - 1
    elif arch == "gpt-oss":
        if rest.endswith("_exps.weight"):
            return t.transpose(-1, -2)  # ggml [E, out, in] -> HF [E, in, out]
    return t


def _interleave(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """[..., I] gate and up -> [..., 2I] with gate at even and up at odd indices."""
    if gate.shape != up.shape:
        raise ModelLoadError(f"expert gate {list(gate.shape)} and up {list(up.shape)} shapes differ")
    return torch.stack((gate, up), dim=-1).reshape(*gate.shape[:-1], 2 * gate.shape[-1])


class HFTensorAssembler:
    """Collects GGUF tensors one at a time and hands back the HF state dict.

    Tensors are renamed and rearranged as they arrive (in the precision they come in, so the
    Gemma norm shift is exact), then stored in `dtype`; the gate and up halves of gpt-oss experts
    wait here until both are present.
    """

    def __init__(
        self,
        arch: str,
        num_attention_heads: int,
        num_key_value_heads: int,
        dtype: torch.dtype = torch.float32,
        linear: tuple[int, int, int, int] | None = None,
    ) -> None:
        check_architecture(arch)
        self.arch = arch
        self.dtype = dtype
        self.n_heads = num_attention_heads
        self.n_kv_heads = num_key_value_heads
        self.linear = linear  # Qwen3.5's linear layers: (key heads, value heads, key dim, value dim)
        self.tensors: dict[str, torch.Tensor | QuantizedWeight | SuperBlockWeight] = {}
        self._halves: dict[str, dict[int, torch.Tensor]] = {}

    def add(self, gguf_name: str, tensor: torch.Tensor) -> None:
        target = hf_target(self.arch, gguf_name)
        if target is None:
            return
        rest = gguf_name.split(".", 2)[2] if gguf_name.startswith("blk.") else gguf_name
        t = _to_hf_layout(self.arch, rest, tensor, self.n_heads, self.n_kv_heads, self.linear)
        if rest.startswith("ffn_gate_up_exps.") and self.arch == "gpt-oss":
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
            joined = (
                torch.cat((halves[0], halves[1]), dim=-2)
                if self.arch in _ROW_JOINED
                else _interleave(halves[0], halves[1])
            )
            self._put(target.hf_name, joined, gguf_name)

    def add_quantized(self, gguf_name: str, qw: QuantizedWeight | SuperBlockWeight) -> None:
        """A matrix kept in integer form: renamed, and its rows rearranged as `add` would."""
        target = hf_target(self.arch, gguf_name)
        if target is None:
            return
        if target.part is not None:
            raise ModelLoadError(f"{gguf_name}: an expert half cannot stay quantized")
        rest = gguf_name.split(".", 2)[2] if gguf_name.startswith("blk.") else gguf_name

        def rows(t: torch.Tensor) -> torch.Tensor:
            return _to_hf_layout(self.arch, rest, t, self.n_heads, self.n_kv_heads, self.linear).contiguous()

        if self.arch in ("gemma3", *_QWEN35) and rest.endswith("norm.weight"):
            raise ModelLoadError(f"{gguf_name}: a norm cannot stay quantized")
        if target.hf_name in self.tensors:
            raise ModelLoadError(f"GGUF file holds {gguf_name} twice")
        self.tensors[target.hf_name] = qw.map_rows(rows)

    def _put(self, hf_name: str, t: torch.Tensor, gguf_name: str) -> None:
        if hf_name in self.tensors:
            raise ModelLoadError(f"GGUF file holds {gguf_name} twice")
        self.tensors[hf_name] = t.to(self.dtype).contiguous()

    def finish(self) -> dict[str, torch.Tensor | QuantizedWeight]:
        """The HF state dict; raises ModelLoadError when an expert half never arrived."""
        if self._halves:
            missing = ", ".join(sorted(self._halves))
            raise ModelLoadError(f"GGUF file has only one of the gate / up expert tensors for {missing}")
        return self.tensors
