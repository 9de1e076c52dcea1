"""GLM-4.5 / 4.6 / 4.7 MoE (`glm4_moe`): what the layers below the models know of it (the model is
`models/glm4_moe.py`).

GGUF (`glm4moe`): every layer full; head_dim from `attention.key_length`; the rotated share of each
head from `rope.dimension_count` (HF's `partial_rotary_factor`, 0.5 in the released models); q/k
norms and q/k/v biases present where their tensors are (the file has no key for them). The first
`leading_dense_block_count` layers have a dense MLP; the others route by sigmoid scores plus the
correction bias (`exp_probs_b.bias`) within `expert_group_used_count` of `expert_group_count`
groups, scaled by `expert_weights_scale`, beside `expert_shared_count` shared experts (one MLP of
that many experts' width). Experts keep ggml's [E, out, in] (= HF's); the separate gate / up stacks
join as `gate_up_proj`, gate rows first. No row permutation (NeoX rope, as HF).

The multi-token-prediction (MTP, "nextn") layers llama.cpp's converter writes after the decoder
layers (`nextn_predict_layers` of them, counted in `block_count`) take HF's names
(`model.layers.{N}.eh_proj.weight`, ...), as in a safetensors checkpoint; the model ignores them.
"""

from __future__ import annotations

from collections.abc import Collection

from freetoken.errors import ModelLoadError
from freetoken.families.base import ATTENTION, DENSE_MLP, FULL, ROWS, Family, GGUFFacts, HFFacts, scaled_rope
from freetoken.families.gguf_keys import Keys

SIGMOID = 2  # llama.cpp's `expert_gating_func` for sigmoid scores (1: softmax)

TENSORS: dict[str, str] = {
    **ATTENTION,
    **DENSE_MLP,
    "attn_norm.weight": "input_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
    "ffn_gate_exps.weight": "mlp.experts.gate_up_proj",
    "ffn_up_exps.weight": "mlp.experts.gate_up_proj",
    "ffn_down_exps.weight": "mlp.experts.down_proj",
    "ffn_gate_shexp.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_experts.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_experts.down_proj.weight",
    # the MTP layers' own tensors (their attention and MLP take the names above)
    "nextn.eh_proj.weight": "eh_proj.weight",
    "nextn.embed_tokens.weight": "embed_tokens.weight",
    "nextn.enorm.weight": "enorm.weight",
    "nextn.hnorm.weight": "hnorm.weight",
    "nextn.shared_head_head.weight": "shared_head.head.weight",
    "nextn.shared_head_norm.weight": "shared_head.norm.weight",
}


def translate(k: Keys, cfg: dict[str, object], tensor_names: Collection[str]) -> None:
    hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])  # type: ignore[call-overload]
    head_dim = k.count("attention.key_length", hidden // heads)
    gating = k.integer("expert_gating_func", SIGMOID)
    if gating != SIGMOID:
        raise ModelLoadError(f"{k.full('expert_gating_func')} is {gating}; GLM-4.5 routes by sigmoid ({SIGMOID})")
    mtp = k.integer("nextn_predict_layers", 0)
    layers = k.count("block_count") - mtp
    if mtp < 0 or layers < 1:
        raise ModelLoadError(f"{k.full('nextn_predict_layers')} {mtp} leaves no decoder layer")
    rope = scaled_rope(k, 10_000.0)
    rope["partial_rotary_factor"] = k.count("rope.dimension_count", head_dim) / head_dim
    cfg.update(
        num_hidden_layers=layers,
        num_nextn_predict_layers=mtp,
        intermediate_size=k.count("feed_forward_length"),
        head_dim=head_dim,
        hidden_act="silu",
        rope_parameters=rope,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        use_qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
        n_routed_experts=k.count("expert_count"),
        num_experts_per_tok=k.count("expert_used_count"),
        moe_intermediate_size=k.count("expert_feed_forward_length"),
        n_shared_experts=k.count("expert_shared_count", 1),
        first_k_dense_replace=k.integer("leading_dense_block_count", 0),
        n_group=k.count("expert_group_count", 1),
        topk_group=k.count("expert_group_used_count", 1),
        routed_scaling_factor=k.positive("expert_weights_scale", 1.0),
        norm_topk_prob=bool(k.raw("expert_weights_norm", False)),
        layer_types=[FULL] * layers,
        sliding_window=None,
    )


FAMILY = Family(
    name="glm4_moe",
    model_types=("glm4_moe",),
    hf=HFFacts(default_context=131_072, default_window=None),
    gguf=GGUFFacts(
        arch="glm4moe",
        model_type="glm4_moe",
        hf_class="Glm4MoeForCausalLM",
        translate=translate,
        tensors=TENSORS,
        experts_join=ROWS,
        float32=frozenset({"ffn_gate_inp.weight", "exp_probs_b.bias"}),  # the router, held in float32 by the model
    ),
    tensor_parallel=None,  # no shard plan: the shared experts and the grouped router
    tool_parser="glm45",
)
