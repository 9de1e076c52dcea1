"""Llama: what the layers below the models know of it (the model is `models/llama.py`).

GGUF (`llama`): every layer full; head_dim from `rope.dimension_count` (else `key_length`, else
hidden / heads); linear rope scaling when the file says so. llama.cpp's converter permutes the
rows of q_proj / k_proj (per head, from HF's "first half / second half" rotary layout to
interleaved pairs); loading undoes it. Mistral GGUFs are written as `llama` and load as Llama.
"""

from __future__ import annotations

from collections.abc import Collection

from freetoken.families.base import (
    ATTENTION,
    DENSE_MLP,
    FULL,
    UNPERMUTE_K_ROWS,
    UNPERMUTE_Q_ROWS,
    Family,
    GGUFFacts,
    HFFacts,
    layers_of,
)
from freetoken.families.gguf_keys import Keys

TENSORS: dict[str, str] = {
    **ATTENTION,
    **DENSE_MLP,
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}


def translate(k: Keys, cfg: dict[str, object], tensor_names: Collection[str]) -> None:
    hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])  # type: ignore[call-overload]
    head_dim = k.count("rope.dimension_count", k.integer("attention.key_length", hidden // heads))
    rope: dict[str, object] = {"rope_type": "default", "rope_theta": k.positive("rope.freq_base", 10_000.0)}
    if k.raw("rope.scaling.type", None) == "linear":
        rope.update(rope_type="linear", factor=k.positive("rope.scaling.factor"))
    cfg.update(
        intermediate_size=k.count("feed_forward_length"),
        head_dim=head_dim,
        hidden_act="silu",
        rope_parameters=rope,
        attention_bias=False,
        mlp_bias=False,
        pretraining_tp=1,
        layer_types=[FULL] * layers_of(cfg),
        sliding_window=None,
    )


def layout(rest: str) -> str | None:
    if rest.startswith("attn_q."):
        return UNPERMUTE_Q_ROWS
    if rest.startswith("attn_k."):
        return UNPERMUTE_K_ROWS
    return None


FAMILY = Family(
    name="llama",
    model_types=("llama",),
    hf=HFFacts(default_context=2048, default_window=None),
    gguf=GGUFFacts(
        arch="llama",
        model_type="llama",
        hf_class="LlamaForCausalLM",
        translate=translate,
        tensors=TENSORS,
        layout=layout,
    ),
    tool_parser="llama3_json",
)
