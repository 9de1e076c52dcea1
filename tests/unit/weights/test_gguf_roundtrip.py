"""HF model -> GGUF (written as llama.cpp's converter lays it out) -> load_gguf -> the same HF
state dict and config, for tiny random Llama, Gemma 3 and gpt-oss models.

The GGUF side follows llama.cpp's convert_hf_to_gguf.py: Llama q/k rows permuted, Gemma norms
stored as w + 1, gpt-oss experts split into gate / up / down stacks in [E, out, in] layout (or one
fused gate_up stack). These need no real file and run in a second.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf_writing import llama_cpp_permute, np32, write_gguf
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GptOssConfig,
    GptOssForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedConfig,
    PreTrainedModel,
)

from freetoken.weights.gguf import load_gguf

VOCAB = 64
TOKENS = [f"t{i}" for i in range(VOCAB)]


def randomized(model: PreTrainedModel, seed: int) -> dict[str, torch.Tensor]:
    """Random values in every parameter; norms rounded to multiples of 1/1024 so that Gemma's
    (w + 1) - 1 is exact in float32."""
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for name, p in model.state_dict().items():
        t = torch.randn(p.shape, generator=g)
        if "norm" in name:
            t = torch.round(t * 1024) / 1024
        sd[name] = t
    return sd


def common_kv(cfg: PreTrainedConfig) -> dict[str, object]:
    return {
        "block_count": cfg.num_hidden_layers,
        "context_length": cfg.max_position_embeddings,
        "embedding_length": cfg.hidden_size,
        "attention.head_count": cfg.num_attention_heads,
        "attention.head_count_kv": cfg.num_key_value_heads,
        "attention.layer_norm_rms_epsilon": cfg.rms_norm_eps,
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": TOKENS,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
    }


def layer_tensors(sd: dict[str, torch.Tensor], i: int, names: dict[str, str]) -> dict[str, torch.Tensor]:
    p = f"model.layers.{i}."
    return {f"blk.{i}.{g}": sd[p + h] for g, h in names.items() if p + h in sd}


def assert_same_state(loaded: dict[str, torch.Tensor], sd: dict[str, torch.Tensor], tied: bool) -> None:
    expected = {k for k in sd if not (tied and k == "lm_head.weight")}
    assert set(loaded) == expected
    for name in expected:
        assert loaded[name].shape == sd[name].shape, name
        assert torch.equal(loaded[name], sd[name]), name


def assert_config_matches(got: dict[str, object], ref: PreTrainedConfig, keys: list[str]) -> None:
    built = type(ref)(**{k: v for k, v in got.items() if k not in ("model_type",)})
    for key in keys:
        assert getattr(built, key) == getattr(ref, key), key
        assert got[key] == getattr(ref, key), key


SHARED_KEYS = [
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "max_position_embeddings", "tie_word_embeddings",
    "rope_parameters", "bos_token_id", "eos_token_id", "attention_bias",
]  # fmt: skip


@pytest.mark.parametrize("tied", [False, True])
def test_llama_roundtrip_undoes_qk_permutation(tmp_path: Path, tied: bool) -> None:
    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=48, intermediate_size=40, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=128, rope_parameters={"rope_type": "default", "rope_theta": 5e4},
        tie_word_embeddings=tied, bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-5,
    )  # fmt: skip
    sd = randomized(LlamaForCausalLM(cfg), seed=1)
    if tied:
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    tensors = {"token_embd.weight": sd["model.embed_tokens.weight"], "output_norm.weight": sd["model.norm.weight"]}
    if not tied:
        tensors["output.weight"] = sd["lm_head.weight"]
    names = {
        "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
        "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
        "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight", "ffn_down.weight": "mlp.down_proj.weight",
    }  # fmt: skip
    for i in range(cfg.num_hidden_layers):
        tensors.update(layer_tensors(sd, i, names))
        tensors[f"blk.{i}.attn_q.weight"] = llama_cpp_permute(sd[f"model.layers.{i}.self_attn.q_proj.weight"], 6)
        tensors[f"blk.{i}.attn_k.weight"] = llama_cpp_permute(sd[f"model.layers.{i}.self_attn.k_proj.weight"], 2)
    kv = common_kv(cfg) | {"feed_forward_length": 40, "rope.freq_base": 5e4, "rope.dimension_count": 8}
    path = write_gguf(tmp_path / "llama.gguf", "llama", kv, {k: np32(v) for k, v in tensors.items()})

    ck = load_gguf(path)
    assert_same_state(ck.tensors, sd, tied)
    assert not torch.equal(tensors["blk.0.attn_q.weight"], sd["model.layers.0.self_attn.q_proj.weight"])
    assert ck.hf_config["model_type"] == "llama" and ck.hf_config["architectures"] == ["LlamaForCausalLM"]
    assert ck.hf_config["layer_types"] == ["full_attention"] * 2 and ck.hf_config["sliding_window"] is None
    assert_config_matches(ck.hf_config, cfg, SHARED_KEYS + ["hidden_act", "mlp_bias"])
    assert ck.quant_types == {"F32": len(tensors)}


def test_gemma3_roundtrip_subtracts_norm_shift(tmp_path: Path) -> None:
    cfg = Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=40, num_hidden_layers=7, num_attention_heads=4,
        num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=16, sliding_window=4, max_position_embeddings=256,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    assert cfg.layer_types[5] == "full_attention" and cfg.layer_types.count("full_attention") == 1
    sd = randomized(Gemma3ForCausalLM(cfg), seed=2)
    sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    tensors = {"token_embd.weight": sd["model.embed_tokens.weight"], "output_norm.weight": sd["model.norm.weight"] + 1}
    names = {
        "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
        "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
        "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight", "ffn_down.weight": "mlp.down_proj.weight",
        "attn_norm.weight": "input_layernorm.weight", "post_attention_norm.weight": "post_attention_layernorm.weight",
        "ffn_norm.weight": "pre_feedforward_layernorm.weight", "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
        "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
    }  # fmt: skip
    for i in range(cfg.num_hidden_layers):
        for g, t in layer_tensors(sd, i, names).items():
            tensors[g] = t + 1 if g.endswith("norm.weight") else t
    kv = common_kv(cfg) | {
        "feed_forward_length": 40, "attention.key_length": 16, "attention.value_length": 16,
        "rope.freq_base": 1e6, "attention.sliding_window": 4, "tokenizer.ggml.padding_token_id": 0,
    }  # fmt: skip
    path = write_gguf(tmp_path / "gemma3.gguf", "gemma3", kv, {k: np32(v) for k, v in tensors.items()})

    ck = load_gguf(path)
    assert_same_state(ck.tensors, sd, tied=True)
    assert ck.hf_config["model_type"] == "gemma3_text"
    # in bfloat16: matrices are decoded straight into it, norms shifted in float32 first and then
    # rounded once, so every tensor is the float32 result rounded
    bf16 = load_gguf(path, dtype=torch.bfloat16).tensors
    assert bf16.keys() == ck.tensors.keys()
    for name, t in ck.tensors.items():
        assert bf16[name].dtype == torch.bfloat16 and torch.equal(bf16[name], t.to(torch.bfloat16)), name
    keys = SHARED_KEYS + ["layer_types", "sliding_window", "query_pre_attn_scalar", "hidden_activation",
                          "final_logit_softcapping", "attn_logit_softcapping", "pad_token_id"]  # fmt: skip
    assert_config_matches(ck.hf_config, cfg, keys)


@pytest.mark.parametrize("fused", [False, True])
def test_gpt_oss_roundtrip_interleaves_experts(tmp_path: Path, fused: bool) -> None:
    cfg = GptOssConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=24, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
        bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    sd = randomized(GptOssForCausalLM(cfg), seed=3)
    tensors = {
        "token_embd.weight": sd["model.embed_tokens.weight"], "output_norm.weight": sd["model.norm.weight"],
        "output.weight": sd["lm_head.weight"],
    }  # fmt: skip
    names = {
        "attn_norm.weight": "input_layernorm.weight", "post_attention_norm.weight": "post_attention_layernorm.weight",
        "attn_sinks.weight": "self_attn.sinks", "ffn_gate_inp.weight": "mlp.router.weight", "ffn_gate_inp.bias": "mlp.router.bias",
        "ffn_down_exps.bias": "mlp.experts.down_proj_bias",
    } | {f"attn_{g}.{k}": f"self_attn.{h}_proj.{k}" for g, h in (("q", "q"), ("k", "k"), ("v", "v"), ("output", "o"))
         for k in ("weight", "bias")}  # fmt: skip
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}.mlp.experts."
        tensors.update(layer_tensors(sd, i, names))
        tensors[f"blk.{i}.ffn_down_exps.weight"] = sd[p + "down_proj"].transpose(-1, -2)  # [E, H, I]
        gate_up = sd[p + "gate_up_proj"].transpose(-1, -2)  # [E, 2I, H], gate rows even, up rows odd
        bias = sd[p + "gate_up_proj_bias"]
        if fused:
            tensors[f"blk.{i}.ffn_gate_up_exps.weight"] = torch.cat((gate_up[:, ::2], gate_up[:, 1::2]), dim=1)
            tensors[f"blk.{i}.ffn_gate_up_exps.bias"] = torch.cat((bias[:, ::2], bias[:, 1::2]), dim=-1)
        else:
            tensors[f"blk.{i}.ffn_gate_exps.weight"] = gate_up[:, ::2]
            tensors[f"blk.{i}.ffn_up_exps.weight"] = gate_up[:, 1::2]
            tensors[f"blk.{i}.ffn_gate_exps.bias"] = bias[:, ::2]
            tensors[f"blk.{i}.ffn_up_exps.bias"] = bias[:, 1::2]
    kv = common_kv(cfg) | {
        "feed_forward_length": 24, "expert_feed_forward_length": 24, "expert_count": 4, "expert_used_count": 2,
        "attention.key_length": 16, "attention.value_length": 16, "attention.sliding_window": 8,
        "rope.freq_base": 150000.0, "rope.scaling.type": "yarn", "rope.scaling.factor": 32.0,
        "rope.scaling.original_context_length": 4096,
    }  # fmt: skip
    path = write_gguf(tmp_path / "gpt-oss.gguf", "gpt-oss", kv, {k: np32(v) for k, v in tensors.items()})

    ck = load_gguf(path)
    assert_same_state(ck.tensors, sd, tied=False)
    assert ck.hf_config["model_type"] == "gpt_oss"
    assert ck.hf_config["layer_types"] == ["sliding_attention", "full_attention", "sliding_attention"]
    keys = SHARED_KEYS + ["layer_types", "sliding_window", "num_local_experts", "num_experts_per_tok",
                          "swiglu_alpha", "swiglu_limit", "hidden_act"]  # fmt: skip
    assert_config_matches(ck.hf_config, cfg, keys)


def test_load_in_bfloat16_and_progress(tmp_path: Path) -> None:
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=8, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=True)  # fmt: skip
    sd = randomized(LlamaForCausalLM(cfg), seed=4)
    tensors = {"token_embd.weight": sd["model.embed_tokens.weight"], "output_norm.weight": sd["model.norm.weight"]}
    kv = common_kv(cfg) | {"feed_forward_length": 8}
    path = write_gguf(tmp_path / "tiny.gguf", "llama", kv, {k: np32(v) for k, v in tensors.items()})
    calls: list[tuple[int, int, int, int]] = []
    ck = load_gguf(path, dtype=torch.bfloat16, progress=lambda *count: calls.append(count))
    assert all(t.dtype == torch.bfloat16 for t in ck.tensors.values())
    assert torch.equal(ck.tensors["model.embed_tokens.weight"], sd["model.embed_tokens.weight"].to(torch.bfloat16))
    # (tensors read, tensors, bytes read, bytes): the bytes are the tensors' float32 data as stored
    total = sum(t.numel() * 4 for t in tensors.values())
    assert [c[:2] for c in calls] == [(1, 2), (2, 2)] and all(c[3] == total for c in calls)
    assert 0 < calls[0][2] < calls[1][2] == total
    assert ck.hf_config["head_dim"] == 8  # hidden / heads when the file has no rope.dimension_count
