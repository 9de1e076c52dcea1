"""Tiny random-weight models written as real checkpoint directories (safetensors + config.json +
tokenizer.json + a ChatML chat template), for engine and server tests.

The weights are seeded transformers models, so the same directory also loads in transformers
as a reference. Vocabulary: the tiny byte-level tokenizer of `freetoken.tokenizer.testing`.
"""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

from freetoken.tokenizer.testing import write_tiny_tokenizer

VOCAB = 320

# Window 7 with page size 4 (not a multiple): prompts of a few dozen tokens cross it many times.
GEMMA3 = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    sliding_window=7,
    sliding_window_pattern=2,
    query_pre_attn_scalar=16,
    rope_local_base_freq=100.0,
    rope_theta=10_000.0,
    max_position_embeddings=1024,
    bos_token_id=0,
    eos_token_id=2,
    pad_token_id=0,
)
LLAMA = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    tie_word_embeddings=True,
    rope_theta=5000.0,
    max_position_embeddings=1024,
    bos_token_id=0,
    eos_token_id=2,
    pad_token_id=0,
)
FAMILIES = {
    "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM, GEMMA3),
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, LLAMA),
}


def write_tiny_model(family: str, directory: Path, seed: int = 0, **overrides: object) -> Path:
    """Write a seeded tiny model of `family` with its tokenizer to `directory`; returns it."""
    config_cls, model_cls, kwargs = FAMILIES[family]
    torch.manual_seed(seed)
    config = config_cls(**{**kwargs, **overrides}, attn_implementation="eager")
    model = model_cls(config).eval()
    with torch.no_grad():  # default inits are near-degenerate (norms at 1): spread the logits
        for name, p in model.named_parameters():
            p.add_(torch.randn_like(p) * (0.1 if "norm" in name else 0.02))
        for name, b in model.named_buffers():  # GLM's router bias moves the choice of experts
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.05)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    write_tiny_tokenizer(directory, vocab_size=VOCAB)
    return directory


# Qwen3, Qwen3-MoE and Gemma 4 (26B-A4B-shaped: wider full-attention heads with fewer kv heads,
# keys reused as values there, experts beside the dense MLP; window 7 over pages of 4).
QWEN3 = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    tie_word_embeddings=True,
    max_position_embeddings=1024,
    rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
    bos_token_id=0,
    eos_token_id=2,
    pad_token_id=0,
)
QWEN3_MOE = dict(
    QWEN3,
    num_hidden_layers=2,
    moe_intermediate_size=32,
    num_experts=4,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    tie_word_embeddings=False,
)
GEMMA4 = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    global_head_dim=32,
    num_global_key_value_heads=1,
    attention_k_eq_v=True,
    sliding_window=7,
    layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
    hidden_size_per_layer_input=0,
    enable_moe_block=True,
    num_experts=4,
    top_k_experts=2,
    moe_intermediate_size=24,
    final_logit_softcapping=30.0,
    max_position_embeddings=1024,
    bos_token_id=0,
    eos_token_id=2,
    pad_token_id=0,
)
FAMILIES.update(
    {
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, QWEN3),
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM, QWEN3_MOE),
        "gemma4": (transformers.Gemma4TextConfig, transformers.Gemma4ForCausalLM, GEMMA4),
    }
)

# Qwen3.5 / Qwen3.5-MoE: Gated DeltaNet (linear attention) layers with 2 key heads over 4 value
# heads (k 8, v 12 channels) beside gated full attention with a quarter of each head rotated.
QWEN3_5 = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=12,
    linear_conv_kernel_dim=4,
    max_position_embeddings=1024,
    rope_parameters={"rope_type": "default", "rope_theta": 5000.0, "partial_rotary_factor": 0.25},
    bos_token_id=0,
    eos_token_id=2,
    pad_token_id=0,
)
QWEN3_5_MOE = dict(
    {k: v for k, v in QWEN3_5.items() if k != "intermediate_size"},
    num_hidden_layers=2,
    layer_types=["linear_attention", "full_attention"],
    moe_intermediate_size=32,
    shared_expert_intermediate_size=48,
    num_experts=4,
    num_experts_per_tok=2,
)
# Qwen3-Next: Qwen3.5-MoE's network with the linear layers' q/k/v/z and b/a projections fused per
# key head (2 key heads over 4 value heads, k 8 != v 12 channels: a wrong row in the split shows),
# one dense layer (`mlp_only_layers`) among three linear ones and a full-attention one.
QWEN3_NEXT = dict(
    QWEN3_5,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=48,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[1],
)
FAMILIES.update(
    {
        "qwen3_5": (transformers.Qwen3_5TextConfig, transformers.Qwen3_5ForCausalLM, QWEN3_5),
        "qwen3_5_moe": (transformers.Qwen3_5MoeTextConfig, transformers.Qwen3_5MoeForCausalLM, QWEN3_5_MOE),
        "qwen3_next": (transformers.Qwen3NextConfig, transformers.Qwen3NextForCausalLM, QWEN3_NEXT),
    }
)

# GLM-4.5 / 4.6 / 4.7 (glm4_moe): a dense first layer (`first_k_dense_replace`), then sigmoid-routed
# experts in 2 groups of 4 (one group kept per token) with a correction bias, a routed scale and a
# shared expert; q/k/v biases, q/k norms, half of each head rotated.
GLM4_MOE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    moe_intermediate_size=32,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    n_shared_experts=1,
    first_k_dense_replace=1,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    use_qk_norm=True,
    attention_bias=True,
    num_nextn_predict_layers=0,
    max_position_embeddings=1024,
    rope_parameters={"rope_type": "default", "rope_theta": 5000.0, "partial_rotary_factor": 0.5},
    bos_token_id=0,
    eos_token_id=2,
    pad_token_id=0,
)
FAMILIES["glm4_moe"] = (transformers.Glm4MoeConfig, transformers.Glm4MoeForCausalLM, GLM4_MOE)
