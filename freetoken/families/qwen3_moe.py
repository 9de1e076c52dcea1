"""Qwen3-MoE: what the layers below the models know of it (the model is `models/qwen3_moe.py`).

GGUF (`qwen3moe`): Qwen3's attention; the top-k router weights are renormalised (llama.cpp always
does: `norm_topk_prob`), and a layer without `ffn_gate_inp` has a dense MLP (`mlp_only_layers`).
Experts keep ggml's [E, out, in] (= HF's); the separate gate / up stacks join as HF's
`gate_up_proj` [E, 2I, H], gate rows first.
"""

from __future__ import annotations

from collections.abc import Collection

from freetoken.families import qwen3
from freetoken.families.base import ROWS, SPLIT_EXPERTS, Family, GGUFFacts, HFFacts, layers_of
from freetoken.families.gguf_keys import Keys

TENSORS: dict[str, str] = {
    **qwen3.TENSORS,
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_exps.weight": "mlp.experts.gate_up_proj",
    "ffn_up_exps.weight": "mlp.experts.gate_up_proj",
    "ffn_down_exps.weight": "mlp.experts.down_proj",
}


def translate(k: Keys, cfg: dict[str, object], tensor_names: Collection[str]) -> None:
    qwen3.translate(k, cfg, tensor_names)
    layers = layers_of(cfg)
    cfg.update(
        num_experts=k.count("expert_count"),
        num_experts_per_tok=k.count("expert_used_count"),
        moe_intermediate_size=k.count("expert_feed_forward_length"),
        norm_topk_prob=bool(k.raw("expert_weights_norm", True)),
        decoder_sparse_step=1,
        mlp_only_layers=[i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensor_names],
    )


FAMILY = Family(
    name="qwen3_moe",
    model_types=("qwen3_moe",),
    hf=HFFacts(default_context=32_768, default_window=None, switched_window=True),
    gguf=GGUFFacts(
        arch="qwen3moe",
        model_type="qwen3_moe",
        hf_class="Qwen3MoeForCausalLM",
        translate=translate,
        tensors=TENSORS,
        experts_join=ROWS,
        float32=frozenset({"ffn_gate_inp.weight"}),  # the router, held in float32 by the model
    ),
    tensor_parallel=SPLIT_EXPERTS,
)
