"""Qwen2 / Qwen2.5: what the layers below the models know of it (the model is `models/qwen2.py`).

GGUF (`qwen2`): every layer full, head_dim hidden / heads, rope base 1e6 unless the file says,
linear / YaRN scaling when it does. Llama's tensor names (the q/k/v biases included); the rows are
not permuted (llama.cpp ropes Qwen NeoX-style, as HF). A `config.json`'s `sliding_window` counts
only with `use_sliding_window` set (Qwen writes a window into every file, usually switched off).
"""

from __future__ import annotations

from collections.abc import Collection

from freetoken.families import llama
from freetoken.families.base import FULL, Family, GGUFFacts, HFFacts, layers_of, scaled_rope
from freetoken.families.gguf_keys import Keys


def translate(k: Keys, cfg: dict[str, object], tensor_names: Collection[str]) -> None:
    hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])  # type: ignore[call-overload]
    cfg.update(
        intermediate_size=k.count("feed_forward_length"),
        head_dim=hidden // heads,
        hidden_act="silu",
        rope_parameters=scaled_rope(k, 1_000_000.0),
        layer_types=[FULL] * layers_of(cfg),
        sliding_window=None,
        use_sliding_window=False,
    )


FAMILY = Family(
    name="qwen2",
    model_types=("qwen2",),
    hf=HFFacts(default_context=32_768, default_window=None, switched_window=True),
    gguf=GGUFFacts(
        arch="qwen2", model_type="qwen2", hf_class="Qwen2ForCausalLM", translate=translate, tensors=llama.TENSORS
    ),
)
