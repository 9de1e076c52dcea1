"""Gemma 4 (text): sliding and full layers with different head shapes, and an MoE beside the MLP.

Owns the Gemma 4 module tree (parameter names follow transformers' Gemma4ForCausalLM without the
`model.` prefix) and its forward over a paged KV cache:

- attention at scale 1 with plain-weight RMSNorms on q and k and an unweighted one on v; full
  layers have their own head_dim / kv heads (`ModelConfig.for_layer`) and, with
  `attention_k_eq_v`, no v_proj (values are the key projection before its norm: loaded as a copy
  of k_proj, so the fused qkv projection stays one matrix);
- rope base 10000 on sliding layers, "proportional" rope on full layers (only the first
  `partial_rotary_factor` of each head's rotary pairs turn);
- four norms per block, plus, in MoE layers (`enable_moe_block`), experts run on the block's input
  beside the dense MLP, each branch with its own norms, summed; the router RMS-norms its input
  (no weight), scales it by `router.scale / sqrt(hidden)`, softmaxes over all experts, keeps the
  top k renormalised and multiplies each by `per_expert_scale`; each block ends multiplied by
  `layer_scalar`;
- embeddings scaled by sqrt(hidden) in the model dtype, final soft-capping.

Also `config_from_hf`, the reader of a Gemma 4 `config.json` dict (the text model's, or the
multimodal checkpoint's `text_config`): Gemma4TextConfig's class defaults, the full layers' wider
heads (`global_head_dim` and `num_global_key_value_heads`, or the saved `per_layer_config`), and
the features FreeToken refuses. Per-layer embeddings and shared KV layers (Gemma 4 E2B / E4B) and
the vision / audio towers are not modelled (the reader refuses the first two; tower tensors are
ignored). It does not read files.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from freetoken.attention.metadata import ForwardBatch
from freetoken.errors import ModelLoadError
from freetoken.kv.tensors import KVTensors
from freetoken.models.config import (
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    ModelConfig,
    RopeConfig,
    hf_get,
    read_common,
    read_rope,
)
from freetoken.models.experts import Experts, take_experts
from freetoken.models.layers import (
    GatedMLP,
    RMSNorm,
    Rotary,
    SelfAttention,
    compute_dtype,
    embedding,
    linear,
    load_named,
    output_logits,
    residual,
    strip_prefix,
    take_all,
)
from freetoken.models.linear import Weight
from freetoken.ops.layers import rms_norm

# Tensors of the multimodal checkpoint that the text model does not use.
_IGNORED = ("vision_tower.", "audio_tower.", "embed_vision.", "embed_audio.", "multi_modal_projector.")
_PREFIXES = ("model.language_model.", "language_model.model.", "language_model.", "model.")


def _norm(dim: int, config: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> RMSNorm:
    return RMSNorm(dim, config.rms_norm_eps, dtype, device, scale_in_float=True)


def gelu_gate(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """One expert's gated GELU: gate, up [n, I] -> gelu_tanh(gate) * up [n, I]."""
    return F.gelu(gate, approximate="tanh") * up


def rotary(rope: RopeConfig, head_dim: int, device: torch.device | str) -> Rotary:
    """A layer kind's rotary table; "proportional" zeroes the frequencies of the unrotated pairs."""
    table = Rotary(rope, head_dim, device)
    if rope.rope_type == "proportional":
        turned = int((rope.partial_rotary_factor or 1.0) * head_dim // 2)
        table.inv_freq = torch.cat([table.inv_freq[:turned], torch.zeros_like(table.inv_freq[turned:])]) / (
            rope.factor or 1.0
        )
    return table


class Gemma4Attention(SelfAttention):
    """Layer `layer`'s own head shape (full layers: wider heads, fewer KV heads), q/k norms, and
    the values RMS-normed without a weight."""

    def __init__(self, config: ModelConfig, layer: int, dtype: torch.dtype, device: torch.device | str) -> None:
        c = config.for_layer(layer)
        super().__init__(c, dtype, device, _norm(c.head_dim, c, dtype, device), _norm(c.head_dim, c, dtype, device))
        self.register_buffer(
            "v_ones", torch.ones(c.head_dim, dtype=compute_dtype(dtype), device=device), persistent=False
        )

    def values(self, v: torch.Tensor) -> torch.Tensor:
        return rms_norm(v, self.v_ones, self.config.rms_norm_eps)  # [T, n_kv, D], unweighted (ones)


class Gemma4Router(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        c = config
        self.config = config
        self.proj = linear(c.hidden_size, c.num_experts, False, dtype, device, quantizable=False)
        self.scale = nn.Parameter(torch.empty(c.hidden_size, dtype=dtype, device=device))
        self.per_expert_scale = nn.Parameter(torch.empty(c.num_experts, dtype=dtype, device=device))
        self.register_buffer(
            "ones", torch.ones(c.hidden_size, dtype=compute_dtype(dtype), device=device), persistent=False
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> expert ids [T, k], weights [T, k] (float32)."""
        c = self.config
        h = rms_norm(x, self.ones, c.rms_norm_eps) * self.scale * c.hidden_size**-0.5  # [T, hidden], unweighted norm
        probs = torch.softmax(self.proj(h), dim=-1, dtype=torch.float32)  # [T, E]
        top, idx = torch.topk(probs, c.num_experts_per_tok, dim=-1)  # [T, k] each
        top = top / top.sum(dim=-1, keepdim=True)
        return idx, top * self.per_expert_scale[idx]


class Gemma4Block(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        c = config
        self.input_layernorm = _norm(c.hidden_size, c, dtype, device)
        self.self_attn = Gemma4Attention(c, layer, dtype, device)
        self.post_attention_layernorm = _norm(c.hidden_size, c, dtype, device)
        self.pre_feedforward_layernorm = _norm(c.hidden_size, c, dtype, device)
        self.mlp = GatedMLP(c.hidden_size, c.intermediate_size, c.hidden_act, False, dtype, device)
        self.post_feedforward_layernorm = _norm(c.hidden_size, c, dtype, device)
        self.layer_scalar = nn.Parameter(torch.empty(1, dtype=dtype, device=device))
        self.moe = c.num_experts > 0
        if self.moe:
            self.router = Gemma4Router(c, dtype, device)
            self.experts = Experts(
                c.num_experts, c.hidden_size, c.moe_intermediate_size, gelu_gate, False, dtype, device
            )
            self.post_feedforward_layernorm_1 = _norm(c.hidden_size, c, dtype, device)
            self.pre_feedforward_layernorm_2 = _norm(c.hidden_size, c, dtype, device)
            self.post_feedforward_layernorm_2 = _norm(c.hidden_size, c, dtype, device)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layer: int, batch: ForwardBatch, kv: KVTensors
    ) -> torch.Tensor:
        h = self.self_attn(self.input_layernorm(x), cos, sin, layer, batch, kv)
        x, y = residual(x, h, self.post_attention_layernorm, self.pre_feedforward_layernorm)
        h = self.mlp(y)  # [T, hidden]
        if self.moe:
            ids, weights = self.router(x)
            moe = self.experts(self.pre_feedforward_layernorm_2(x), ids, weights)  # [T, hidden]
            h = self.post_feedforward_layernorm_1(h) + self.post_feedforward_layernorm_2(moe)
        x, _ = residual(x, h, self.post_feedforward_layernorm, None)
        return x * self.layer_scalar


class Gemma4ForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        c = config
        self.config = config
        self.embed_tokens = embedding(c.vocab_size, c.hidden_size, dtype, device)
        self.layers = nn.ModuleList(Gemma4Block(c, i, dtype, device) for i in range(c.num_layers))
        self.norm = _norm(c.hidden_size, c, dtype, device)
        self.lm_head = None if c.tie_word_embeddings else linear(c.hidden_size, c.vocab_size, False, dtype, device)
        full = c.for_layer(c.full_layers[0]) if c.full_layers else c
        self.rotary_full = rotary(c.rope_full, full.head_dim, device)
        self.rotary_sliding = rotary(c.rope_sliding, c.head_dim, device)
        # transformers rounds sqrt(hidden) to the model dtype, as Gemma 3 does.
        self.embed_scale = torch.tensor(c.hidden_size**0.5, dtype=torch.float32).to(dtype)

    def _local_names(self, tensors: Mapping[str, Weight]) -> dict[str, Weight]:
        """Checkpoint names without their `model.` / `model.language_model.` prefix, towers dropped,
        the GGUF loader's packed expert lists (`layers.N.mlp.experts.*`, its name in every
        family) moved to Gemma 4's `layers.N.experts.*`, and each k_eq_v layer's missing v_proj
        filled with its k_proj (values = key projection)."""
        out: dict[str, Weight] = {}
        for name, t in tensors.items():
            local = strip_prefix(name, _PREFIXES).replace(".mlp.experts.", ".experts.")
            if not (local.startswith(_IGNORED) or (local == "lm_head.weight" and self.lm_head is None)):
                out[local] = t
        if self.config.attention_k_eq_v:
            for i in self.config.full_layers:
                for leaf in ("weight", "bias"):
                    k, v = f"layers.{i}.self_attn.k_proj.{leaf}", f"layers.{i}.self_attn.v_proj.{leaf}"
                    if k in out and v not in out:
                        out[v] = out[k]
        return out

    def load_weights(
        self, tensors: MutableMapping[str, Weight], weights: str = "auto", prefill_weights: str = "quantized"
    ) -> None:
        """Load HF-named tensors (text-only or multimodal Gemma 4 checkpoints) under the `--weights`
        policy (routers stay float; experts follow the policy)."""
        rest = self._local_names(take_all(tensors))
        for i, layer in enumerate(self.layers):
            if layer.moe:
                c = self.config
                layer.experts.load(
                    *take_experts(rest, f"layers.{i}.experts.", c.num_experts, c.moe_intermediate_size, weights)
                )
        load_named(self, rest, lambda name: name, weights, prefill_weights)

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch, kv: KVTensors) -> torch.Tensor:
        """input_ids [T] -> logits [N, vocab] for the rows batch.logits_indices."""
        x = self.embed_tokens(input_ids) * self.embed_scale.to(input_ids.device)  # [T, hidden]
        rope_full = self.rotary_full.cos_sin(batch.positions)  # ([T, D_full / 2], ...) float32
        rope_sliding = self.rotary_sliding.cos_sin(batch.positions)  # ([T, D / 2], ...)
        for i, layer in enumerate(self.layers):
            cos, sin = rope_sliding if self.config.is_sliding(i) else rope_full
            x = layer(x, cos, sin, i, batch, kv)
        softcap = self.config.final_logit_softcapping
        return output_logits(x, batch, self.norm, self.embed_tokens, self.lm_head, softcap)  # [N, vocab]


# --- reading config.json -------------------------------------------------------------------------


_DEFAULTS = dict(
    vocab_size=262_144,
    hidden_size=2304,
    intermediate_size=9216,
    num_hidden_layers=30,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=256,
    rms_norm_eps=1e-6,
    max_position_embeddings=131_072,
    tie_word_embeddings=True,
    attention_bias=False,
    bos_token_id=2,
    eos_token_id=1,
    pad_token_id=0,
)
GLOBAL_HEAD_DIM = 512  # Gemma4TextConfig's default global_head_dim
PARTIAL_ROTARY = 0.25  # the full layers' default proportional rope share


def _full_heads(config: Mapping[str, Any], layer_types: list[str], kv_heads: int) -> tuple[int, int]:
    """(head_dim, kv heads) of the full-attention layers: the saved `per_layer_config` (uniform over
    the full layers, none on sliding ones), or `global_head_dim` / `num_global_key_value_heads` as
    Gemma4TextConfig derives it (the kv override only with attention_k_eq_v)."""
    saved = config.get("per_layer_config")
    if isinstance(saved, Mapping):
        shapes = {int(i): (v.get("head_dim"), v.get("num_key_value_heads")) for i, v in saved.items()}
        full = {shapes.get(i) for i, t in enumerate(layer_types) if t == FULL_ATTENTION}
        if len(full) > 1 or any(layer_types[i] != FULL_ATTENTION for i in shapes):
            raise ModelLoadError(
                f"gemma4 per_layer_config must give every full-attention layer one shape, got {dict(saved)}"
            )
        head_dim, heads = full.pop() if full else (None, None)
        return int(head_dim or hf_get(config, "head_dim", 256)), int(heads or kv_heads)
    heads = config.get("num_global_key_value_heads") if hf_get(config, "attention_k_eq_v", False) else None
    return int(hf_get(config, "global_head_dim", GLOBAL_HEAD_DIM)), int(heads or kv_heads)


def config_from_hf(config: Mapping[str, Any]) -> ModelConfig:
    """A Gemma 4 `config.json` dict as a ModelConfig: the text model's (model_type "gemma4_text"),
    or the multimodal checkpoint's ("gemma4"), whose `text_config` it reads."""
    if config.get("model_type") == "gemma4":
        text = config.get("text_config")
        if not isinstance(text, Mapping):
            raise ModelLoadError("gemma4 config.json has no text_config")
        config = {**text, "model_type": "gemma4_text"}
    if int(hf_get(config, "hidden_size_per_layer_input", 256)):
        raise ModelLoadError(
            "gemma4 with per-layer embeddings (hidden_size_per_layer_input > 0, Gemma 4 E2B/E4B) is not supported"
        )
    if int(hf_get(config, "num_kv_shared_layers", 0)):
        raise ModelLoadError("gemma4 with shared KV layers (num_kv_shared_layers > 0) is not supported")
    if config.get("use_bidirectional_attention") == "all":
        raise ModelLoadError("gemma4 with use_bidirectional_attention='all' is not supported")
    common = read_common(config, _DEFAULTS)
    n = common["num_layers"]
    layer_types = list(
        config.get("layer_types") or [SLIDING_ATTENTION if (i + 1) % 6 else FULL_ATTENTION for i in range(n)]
    )
    layer_types[-1] = FULL_ATTENTION  # as Gemma4TextConfig forces
    global_dim, global_heads = _full_heads(config, layer_types, common["num_kv_heads"])
    params = config.get("rope_parameters") or {}
    full = dict(params.get(FULL_ATTENTION) or {"rope_type": "proportional", "partial_rotary_factor": PARTIAL_ROTARY})
    moe = bool(hf_get(config, "enable_moe_block", False))
    return ModelConfig(
        architecture="gemma4",
        **common,
        layer_types=tuple(layer_types),
        rope_full=read_rope(full, 1_000_000.0),
        rope_sliding=read_rope(params.get(SLIDING_ATTENTION) or {}, 10_000.0),
        sliding_window=int(hf_get(config, "sliding_window", 512)),
        hidden_act=str(hf_get(config, "hidden_activation", "gelu_pytorch_tanh")),
        query_pre_attn_scalar=1.0,  # Gemma 4 attends with scale 1 (its q/k norms set the logits' size)
        final_logit_softcapping=config.get("final_logit_softcapping"),
        num_experts=int(hf_get(config, "num_experts", 0)) if moe else 0,
        num_experts_per_tok=int(hf_get(config, "top_k_experts", 0)) if moe else 0,
        moe_intermediate_size=int(hf_get(config, "moe_intermediate_size", 0)) if moe else 0,
        global_head_dim=global_dim,
        num_global_kv_heads=global_heads,
        attention_k_eq_v=bool(hf_get(config, "attention_k_eq_v", False)),
    )
