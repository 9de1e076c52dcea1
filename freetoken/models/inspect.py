"""`ft inspect`: a human-readable summary of a checkpoint.

Owns the text `ft inspect` prints: architecture, layer kinds and windows, vocabulary, quant
types and parameter count. It builds no model and allocates no KV memory.
"""

from __future__ import annotations

import torch

from freetoken.models.config import SLIDING_ATTENTION, ModelConfig
from freetoken.models.load import load_tokenizer
from freetoken.tokenizer.chat_template import builtin_chat_template
from freetoken.weights.loader import load_checkpoint, resolve_model


def _layer_kinds(config: ModelConfig) -> str:
    kinds = ["S" if t == SLIDING_ATTENTION else "F" for t in config.layer_types]
    full = [i for i, t in enumerate(config.layer_types) if t != SLIDING_ATTENTION]
    text = "".join(kinds) + f"  (S = sliding window, F = full; full at {full})"
    return text


def describe_model(spec: str | None) -> str:
    source = resolve_model(spec)
    ckpt = load_checkpoint(source, torch.bfloat16)
    config = ModelConfig.from_hf(ckpt.hf_config)
    tok = load_tokenizer(source, ckpt.metadata)
    params = sum(t.numel() for t in ckpt.tensors.values())
    quant = ", ".join(f"{k} x{v}" for k, v in sorted(ckpt.quant_types.items())) or "none (safetensors)"
    if config.tie_word_embeddings:
        params -= sum(t.numel() for n, t in ckpt.tensors.items() if n == "lm_head.weight")
    if not tok.chat_template:
        template = "none"
    elif tok.chat_template == builtin_chat_template(config.architecture):
        template = f"built-in ({config.architecture}; the checkpoint has none)"
    else:
        template = "from the checkpoint"
    lines = [
        f"model:         {source.name}",
        f"path:          {source.path}",
        f"architecture:  {config.architecture}",
        f"layers:        {config.num_layers}",
        f"layer kinds:   {_layer_kinds(config)}",
        f"window:        {config.sliding_window if config.has_swa else 'none'}",
        f"hidden:        {config.hidden_size}, intermediate {config.intermediate_size}",
        f"heads:         {config.num_heads} query, {config.num_kv_heads} kv, head_dim {config.head_dim}",
        f"rope base:     full {config.rope_full.theta:g}, sliding {config.rope_sliding.theta:g}",
        f"experts:       {config.num_experts} (top {config.num_experts_per_tok})" if config.num_experts else "experts:       none",
        f"context:       {config.max_position_embeddings}",
        f"vocabulary:    {tok.vocab_size} (bos {tok.bos_id}, eos {tok.eos_id})",
        f"chat template: {template}",
        f"quant types:   {quant}",
        f"parameters:    {params:,}",
    ]
    return "\n".join(lines)
