"""Gemma 3 (text): interleaved sliding-window and global layers over a paged KV cache.

Owns the Gemma 3 module tree (parameter names follow transformers' Gemma3ForCausalLM without the
`model.` prefix) and its forward: embeddings scaled by sqrt(hidden) in the model dtype, q/k
norms, four (1 + w) RMSNorms per block, separate rope bases for local and global layers, the
query_pre_attn_scalar attention scale and optional soft-capping; and `config_from_hf`, the reader
of a Gemma 3 `config.json` dict (the text model's, or the multimodal checkpoint's `text_config`),
with Gemma3TextConfig's class defaults and the legacy rope keys. It does not read files.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from typing import Any

import torch
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
from freetoken.models.linear import Weight
from freetoken.models.layers import (
    GatedMLP,
    RMSNorm,
    Rotary,
    SelfAttention,
    embedding,
    linear,
    load_named,
    output_logits,
    residual,
    strip_prefix,
)

# Tensors of the multimodal checkpoint that the text model does not use.
_IGNORED = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")
_PREFIXES = ("model.language_model.", "language_model.model.", "language_model.", "model.")


def _norm(dim: int, config: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> RMSNorm:
    return RMSNorm(dim, config.rms_norm_eps, dtype, device, unit_offset=True, scale_in_float=True)


class Gemma3Block(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        c = config
        self.input_layernorm = _norm(c.hidden_size, c, dtype, device)
        self.self_attn = SelfAttention(
            c, dtype, device, _norm(c.head_dim, c, dtype, device), _norm(c.head_dim, c, dtype, device)
        )
        self.post_attention_layernorm = _norm(c.hidden_size, c, dtype, device)
        self.pre_feedforward_layernorm = _norm(c.hidden_size, c, dtype, device)
        self.mlp = GatedMLP(c.hidden_size, c.intermediate_size, c.hidden_act, False, dtype, device)
        self.post_feedforward_layernorm = _norm(c.hidden_size, c, dtype, device)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layer: int, batch: ForwardBatch, kv: KVTensors
    ) -> torch.Tensor:
        h = self.self_attn(self.input_layernorm(x), cos, sin, layer, batch, kv)
        x, y = residual(x, h, self.post_attention_layernorm, self.pre_feedforward_layernorm)
        x, _ = residual(x, self.mlp(y), self.post_feedforward_layernorm, None)
        return x


class Gemma3ForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        c = config
        self.config = config
        self.embed_tokens = embedding(c.vocab_size, c.hidden_size, dtype, device)
        self.layers = nn.ModuleList(Gemma3Block(c, dtype, device) for _ in range(c.num_layers))
        self.norm = _norm(c.hidden_size, c, dtype, device)
        self.lm_head = None if c.tie_word_embeddings else linear(c.hidden_size, c.vocab_size, False, dtype, device)
        self.rotary_full = Rotary(c.rope_full, c.head_dim, device)
        self.rotary_sliding = Rotary(c.rope_sliding, c.head_dim, device)
        # transformers rounds sqrt(hidden) to the model dtype (55.4256 becomes 55.5 in bfloat16).
        self.embed_scale = torch.tensor(c.hidden_size**0.5, dtype=torch.float32).to(dtype)

    def _rename(self, name: str) -> str | None:
        if name.startswith(_IGNORED) or (name == "lm_head.weight" and self.lm_head is None):
            return None
        return strip_prefix(name, _PREFIXES)

    def load_weights(
        self, tensors: MutableMapping[str, Weight], weights: str = "auto", prefill_weights: str = "quantized"
    ) -> None:
        """Load HF-named tensors (text-only or multimodal Gemma 3 checkpoints) under the `--weights` policy."""
        load_named(self, tensors, self._rename, weights, prefill_weights)

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch, kv: KVTensors) -> torch.Tensor:
        """input_ids [T] -> logits [N, vocab] for the rows batch.logits_indices."""
        x = self.embed_tokens(input_ids) * self.embed_scale.to(input_ids.device)  # [T, hidden]
        rope_full = self.rotary_full.cos_sin(batch.positions)  # ([T, D / 2], [T, D / 2]) float32
        rope_sliding = self.rotary_sliding.cos_sin(batch.positions)
        for i, layer in enumerate(self.layers):
            cos, sin = rope_sliding if self.config.is_sliding(i) else rope_full
            x = layer(x, cos, sin, i, batch, kv)
        softcap = self.config.final_logit_softcapping
        return output_logits(x, batch, self.norm, self.embed_tokens, self.lm_head, softcap)  # [N, vocab]


# --- reading config.json -------------------------------------------------------------------------


def config_from_hf(config: Mapping[str, Any]) -> ModelConfig:
    """A Gemma 3 `config.json` dict as a ModelConfig: the text model's (model_type "gemma3_text"),
    or the multimodal checkpoint's ("gemma3"), whose `text_config` it reads."""
    if config.get("model_type") == "gemma3":
        text = config.get("text_config")
        if not isinstance(text, Mapping):
            raise ModelLoadError("gemma3 config.json has no text_config")
        config = {**text, "model_type": "gemma3_text"}
    if config.get("use_bidirectional_attention"):
        raise ModelLoadError("gemma3 with use_bidirectional_attention is not supported")
    defaults = dict(
        vocab_size=262_208,
        hidden_size=2304,
        intermediate_size=9216,
        num_hidden_layers=26,
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
    common = read_common(config, defaults)
    num_layers = common["num_layers"]
    layer_types = config.get("layer_types")
    if layer_types is None:
        pattern = int(hf_get(config, "sliding_window_pattern", 6))
        layer_types = [SLIDING_ATTENTION if (i + 1) % pattern else FULL_ATTENTION for i in range(num_layers)]

    params = config.get("rope_parameters")
    if isinstance(params, Mapping) and FULL_ATTENTION in params:
        rope_full = read_rope(params[FULL_ATTENTION] or {}, 1_000_000.0)
        rope_sliding = read_rope(params.get(SLIDING_ATTENTION) or {}, 10_000.0)
    else:  # legacy keys: rope_scaling applies to the global layers only
        scaling = dict(params or config.get("rope_scaling") or {})
        rope_full = read_rope(scaling, float(hf_get(config, "rope_theta", 1_000_000.0)))
        rope_sliding = RopeConfig(theta=float(hf_get(config, "rope_local_base_freq", 10_000.0)))
    return ModelConfig(
        architecture="gemma3",
        **common,
        layer_types=tuple(layer_types),
        rope_full=rope_full,
        rope_sliding=rope_sliding,
        sliding_window=int(hf_get(config, "sliding_window", 4096)),
        hidden_act=str(hf_get(config, "hidden_activation", hf_get(config, "hidden_act", "gelu_pytorch_tanh"))),
        query_pre_attn_scalar=float(hf_get(config, "query_pre_attn_scalar", 256)),
        attn_logit_softcapping=config.get("attn_logit_softcapping"),
        final_logit_softcapping=config.get("final_logit_softcapping"),
    )
