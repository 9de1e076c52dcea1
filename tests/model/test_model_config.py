"""Each family's config reader (`registry.config_from_hf`) on hub-style config.json dicts (old
and new rope keys), cross-checked with transformers' own reading of the same dict."""

from __future__ import annotations

import pytest
import torch
import transformers

from freetoken.errors import ModelLoadError
from freetoken.kv.tensors import KVTensors
from freetoken.models.config import FULL_ATTENTION, SLIDING_ATTENTION
from freetoken.models.registry import config_from_hf

# Gemma 3 270M as published (legacy rope keys).
GEMMA3_270M = {
    "model_type": "gemma3_text",
    "architectures": ["Gemma3ForCausalLM"],
    "hidden_size": 640,
    "intermediate_size": 2048,
    "num_hidden_layers": 18,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 256,
    "vocab_size": 262144,
    "max_position_embeddings": 32768,
    "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-6,
    "rope_local_base_freq": 10000.0,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "sliding_window": 512,
    "sliding_window_pattern": 6,
    "final_logit_softcapping": None,
    "attn_logit_softcapping": None,
    "bos_token_id": 2,
    "eos_token_id": 1,
    "pad_token_id": 0,
    "hidden_activation": "gelu_pytorch_tanh",
    "use_bidirectional_attention": False,
}
# Gemma 3 4B multimodal: a partial text_config that relies on class defaults, linear rope scaling.
GEMMA3_4B = {
    "model_type": "gemma3",
    "text_config": {
        "model_type": "gemma3_text",
        "hidden_size": 2560,
        "intermediate_size": 10240,
        "num_hidden_layers": 34,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "sliding_window": 1024,
    },
}
GPT_OSS_20B = {
    "model_type": "gpt_oss",
    "hidden_size": 2880,
    "intermediate_size": 2880,
    "num_hidden_layers": 24,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "vocab_size": 201088,
    "num_local_experts": 32,
    "num_experts_per_tok": 4,
    "sliding_window": 128,
    "rope_theta": 150000,
    "rope_scaling": {
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "factor": 32.0,
        "original_max_position_embeddings": 4096,
        "rope_type": "yarn",
        "truncate": False,
    },
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "attention_bias": True,
    "swiglu_limit": 7.0,
    "eos_token_id": 200002,
    "pad_token_id": 199999,
    "tie_word_embeddings": False,
    "layer_types": ["sliding_attention", "full_attention"] * 12,
}
SMOLLM2 = {
    "model_type": "llama",
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "vocab_size": 49152,
    "rope_theta": 100000,
    "rope_scaling": None,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def via_transformers(d: dict) -> dict:
    """The same dict after a round trip through transformers (new-style rope_parameters)."""
    config = transformers.AutoConfig.for_model(**d)
    return config.to_dict()


def test_gemma3_270m() -> None:
    c = config_from_hf(GEMMA3_270M)
    assert c.architecture == "gemma3" and c.has_swa
    assert c.full_layers == (5, 11, 17)
    assert c.swa_layers == tuple(i for i in range(18) if i not in (5, 11, 17))
    assert (c.rope_full.theta, c.rope_sliding.theta) == (1_000_000.0, 10_000.0)
    assert c.sliding_window == 512 and c.tie_word_embeddings and c.attention_scale == 256**-0.5
    assert c.bos_token_id == 2 and c.eos_token_ids == (1,)
    assert config_from_hf(via_transformers(GEMMA3_270M)) == c


def test_gemma3_multimodal_nested_text_config() -> None:
    c = config_from_hf(GEMMA3_4B)
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size) == (8, 4, 256, 262_208)
    assert c.rope_full.rope_type == "linear" and c.rope_full.factor == 8.0
    assert c.rope_sliding.rope_type == "default" and c.rope_sliding.theta == 10_000.0
    assert c.layer_types[:6] == (SLIDING_ATTENTION,) * 5 + (FULL_ATTENTION,)
    assert config_from_hf(transformers.Gemma3Config(text_config=GEMMA3_4B["text_config"]).to_dict()) == c


def test_gpt_oss_20b() -> None:
    c = config_from_hf(GPT_OSS_20B)
    assert c.architecture == "gpt_oss" and c.layer_types[:2] == (SLIDING_ATTENTION, FULL_ATTENTION)
    assert (c.num_experts, c.num_experts_per_tok, c.sliding_window) == (32, 4, 128)
    r = c.rope_full
    assert (r.rope_type, r.factor, r.theta, r.original_max_position_embeddings, r.truncate) == (
        "yarn",
        32.0,
        150000.0,
        4096,
        False,
    )
    assert c.attention_bias and not c.tie_word_embeddings and c.eos_token_ids == (200002,)
    assert config_from_hf(via_transformers(GPT_OSS_20B)) == c


def test_smollm2() -> None:
    c = config_from_hf(SMOLLM2)
    assert c.architecture == "llama" and not c.has_swa and c.swa_layers == ()
    assert c.full_layers == tuple(range(30)) and c.head_dim == 64 and c.rope_full.theta == 100000.0
    assert config_from_hf(via_transformers(SMOLLM2)) == c


def test_unsupported_model_type() -> None:
    with pytest.raises(ModelLoadError, match="unsupported model_type 'mamba'"):
        config_from_hf({"model_type": "mamba"})
    with pytest.raises(ModelLoadError, match="text_config"):
        config_from_hf({"model_type": "gemma3"})


def test_kv_tensors_pools_and_null_page() -> None:
    c = config_from_hf({**GEMMA3_270M, "num_hidden_layers": 3, "sliding_window_pattern": 3})
    kv = KVTensors(c.kv_layout(), full_pages=5, swa_pages=2, page_size=4, dtype=torch.float32, device="cpu")
    assert kv.k[0].shape == (3, 4, 1, 256) and kv.k[2].shape == (6, 4, 1, 256)
    k = torch.randn(3, 1, 256)
    kv.write(2, torch.tensor([4 * 5 + 3, 4 + 0, 4 + 1]), k, -k)
    gk, gv = kv.gather(2, torch.tensor([[1, 5]]))
    assert torch.equal(gk[0, 0], k[1]) and torch.equal(gk[0, 1], k[2]) and torch.equal(gk[0, 7], k[0])
    assert torch.equal(gv[0, 7], -k[0]) and kv.null_pages_are_zero()
    assert KVTensors.bytes_per_page(c.kv_layout(), 4, torch.bfloat16, sliding=True) == 2 * 2 * 4 * 256 * 2
    with pytest.raises(ValueError, match="SWA pages"):
        KVTensors(c.kv_layout(), full_pages=5, swa_pages=0, page_size=4, dtype=torch.float32, device="cpu")


def test_load_weights_names_missing_unexpected_and_misshaped() -> None:
    from freetoken.models.registry import build_model

    c = config_from_hf(
        {
            **SMOLLM2,
            "hidden_size": 32,
            "intermediate_size": 16,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "vocab_size": 10,
        }
    )
    model = build_model(c, torch.float32, "cpu")
    good = {f"model.{n}": torch.zeros_like(p) for n, p in model.named_parameters()}
    good["lm_head.weight"] = torch.zeros(10, 32)  # tied: a saved head is ignored
    model.load_weights(dict(good))  # load_weights empties the mapping it is given
    missing = {k: v for k, v in good.items() if k != "model.norm.weight"}
    with pytest.raises(ModelLoadError, match=r"missing tensors: norm\.weight"):
        model.load_weights(missing)
    with pytest.raises(ModelLoadError, match=r"unexpected tensors: model\.layers\.7\.mlp\.up_proj\.weight"):
        model.load_weights({**good, "model.layers.7.mlp.up_proj.weight": torch.zeros(1)})
    with pytest.raises(ModelLoadError, match=r"model\.norm\.weight has shape \(31,\)"):
        model.load_weights({**good, "model.norm.weight": torch.zeros(31)})
