"""`ft inspect`: a human-readable summary of a checkpoint.

Owns the text `ft inspect` prints: architecture, layer kinds and windows, vocabulary, quant
types, parameter count and what each weight runs as under the `--weights` policy (so it builds
the model, on the CPU). It allocates no KV memory.
"""

from __future__ import annotations

import re
from collections import Counter

import torch

from freetoken.models.config import SLIDING_ATTENTION, ModelConfig
from freetoken.models.experts import Experts
from freetoken.models.linear import QuantizableWeight
from freetoken.models.load import load_model
from freetoken.tokenizer.chat_template import builtin_chat_template


def _layer_kinds(config: ModelConfig) -> str:
    kinds = ["S" if t == SLIDING_ATTENTION else "F" for t in config.layer_types]
    full = [i for i, t in enumerate(config.layer_types) if t != SLIDING_ATTENTION]
    text = "".join(kinds) + f"  (S = sliding window, F = full; full at {full})"
    return text


def weight_kinds(model: torch.nn.Module) -> list[str]:
    """One line per projection kind: `layers.*.self_attn.qkv_proj  int8 (group 32)  x18  [out, in]`."""
    kinds: Counter[tuple[str, str, tuple[int, int]]] = Counter()
    for name, module in model.named_modules():
        if isinstance(module, QuantizableWeight):
            shape = (
                (module.packed.out_features, module.packed.in_features)
                if module.packed is not None
                else tuple(module.weight.shape)
            )
            kinds[(re.sub(r"\.\d+\.", ".*.", name), module.runs_as(), shape)] += 1  # type: ignore[index]
        elif isinstance(module, Experts):  # [E, I, H]: E experts, each gate / up [I, H] and down [H, I]
            shape = (module.num_experts, module.intermediate, module.hidden)
            kinds[(re.sub(r"\.\d+\.", ".*.", name), module.runs_as(), shape)] += 1  # type: ignore[index]
    width = max((len(k[0]) for k in kinds), default=0)
    return [f"  {name:<{width}}  {runs:<16} x{n:<3} {list(shape)}" for (name, runs, shape), n in kinds.items()]


def _param_count(model: torch.nn.Module) -> int:
    count = sum(p.numel() for p in model.parameters())
    experts = sum(
        m.num_experts * (3 * m.intermediate * m.hidden + (2 * m.intermediate + m.hidden if m.bias else 0))
        for m in model.modules()
        if isinstance(m, Experts)
    )
    return (
        count
        + experts
        + sum(
            m.packed.out_features * m.packed.in_features
            for m in model.modules()
            if isinstance(m, QuantizableWeight) and m.packed is not None
        )
    )


def describe_model(spec: str | None, weights: str = "auto") -> str:
    loaded = load_model(spec, torch.bfloat16, torch.device("cpu"), weights)
    source, config, tok = loaded.source, loaded.config, loaded.tokenizer
    quant = ", ".join(f"{k} x{v}" for k, v in sorted(loaded.quant_types.items())) or "none (safetensors)"
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
        f"experts:       {config.num_experts} (top {config.num_experts_per_tok})"
        if config.num_experts
        else "experts:       none",
        f"context:       {config.max_position_embeddings}",
        f"vocabulary:    {tok.vocab_size} (bos {tok.bos_id}, eos {tok.eos_id})",
        f"chat template: {template}",
        f"quant types:   {quant}",
        f"parameters:    {_param_count(loaded.model):,}",
        f"weights:       --weights {weights}; matrices run as (activations bfloat16):",
        *weight_kinds(loaded.model),
    ]
    return "\n".join(lines)
