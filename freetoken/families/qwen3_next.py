"""Qwen3-Next (Qwen3-Next-80B-A3B; `qwen3_next`): what the layers below the models know of it
(the model is `models/qwen3_5.py`).

The same network as Qwen3.5-MoE's text model (Gated DeltaNet layers, gated full attention over a
quarter of each head, routed experts beside a gated shared expert, `(1 + w)` norms), with two
differences the model's reader and loader handle: the linear layers' input projections are stored
fused, `in_proj_qkvz` and `in_proj_ba`, their rows grouped by key head (split at load into
Qwen3.5's `in_proj_qkv` / `in_proj_z` / `in_proj_b` / `in_proj_a`), and the config names dense
layers (`mlp_only_layers`, `decoder_sparse_step`) and whether the top k are renormalised
(`norm_topk_prob`). Safetensors only: llama.cpp's `qwen3next` GGUF is not read yet.
"""

from __future__ import annotations

from freetoken.families.base import Family, HFFacts

FAMILY = Family(
    name="qwen3_next",
    model_types=("qwen3_next",),
    hf=HFFacts(default_context=32_768, default_window=None),
    tensor_parallel=None,  # no shard plan: the linear layers' recurrent states, the shared expert
)
