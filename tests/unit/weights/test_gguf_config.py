"""hf_config_from_metadata on hand-written metadata: the rules for what GGUF files leave out."""

from __future__ import annotations

import pytest
from transformers import AutoConfig

from freetoken.errors import ModelLoadError
from freetoken.weights.gguf_config import hf_config_from_metadata


def gemma3_metadata(layers: int, hidden: int = 640, heads: int = 4, **extra: object) -> dict[str, object]:
    md: dict[str, object] = {
        "general.architecture": "gemma3",
        "gemma3.block_count": layers,
        "gemma3.context_length": 32768,
        "gemma3.embedding_length": hidden,
        "gemma3.feed_forward_length": 2048,
        "gemma3.attention.head_count": heads,
        "gemma3.attention.head_count_kv": 1,
        "gemma3.attention.key_length": 128,
        "gemma3.attention.layer_norm_rms_epsilon": 1e-6,
        "gemma3.rope.freq_base": 1e6,
        "gemma3.attention.sliding_window": 1024,
        "tokenizer.ggml.tokens": ["a", "b", "c"],
    }
    md.update({f"gemma3.{k}": v for k, v in extra.items()})
    return md


def test_gemma3_pattern_and_defaults() -> None:
    cfg = hf_config_from_metadata(gemma3_metadata(12), ["token_embd.weight"])
    assert cfg["layer_types"] == (["sliding_attention"] * 5 + ["full_attention"]) * 2
    assert cfg["query_pre_attn_scalar"] == 128 and cfg["vocab_size"] == 3
    assert cfg["final_logit_softcapping"] is None and cfg["attn_logit_softcapping"] is None
    assert cfg["pad_token_id"] is None and cfg["tie_word_embeddings"] is True
    AutoConfig.for_model(**cfg)  # accepted by transformers as is


def test_gemma3_27b_scales_queries_by_hidden_over_heads() -> None:
    cfg = hf_config_from_metadata(gemma3_metadata(62, hidden=5376, heads=32), [])
    assert cfg["query_pre_attn_scalar"] == 168


def test_gemma3_explicit_pattern_softcap_and_linear_rope() -> None:
    md = gemma3_metadata(
        4,
        **{
            "attention.sliding_window_pattern": [True, False, True, False],
            "final_logit_softcapping": 30.0,
            "rope.scaling.type": "linear",
            "rope.scaling.factor": 8.0,
        },
    )
    cfg = hf_config_from_metadata(md, ["output.weight"])
    assert cfg["layer_types"] == ["sliding_attention", "full_attention"] * 2
    assert cfg["final_logit_softcapping"] == 30.0 and cfg["tie_word_embeddings"] is False
    rope = cfg["rope_parameters"]
    assert rope["full_attention"] == {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0}  # type: ignore[index]
    assert rope["sliding_attention"] == {"rope_type": "default", "rope_theta": 10_000.0}  # type: ignore[index]


def test_pattern_of_wrong_length_is_refused() -> None:
    md = gemma3_metadata(4, **{"attention.sliding_window_pattern": [True, False]})
    with pytest.raises(ModelLoadError, match="2 entries for 4 layers"):
        hf_config_from_metadata(md, [])


def test_unsupported_and_missing_architecture() -> None:
    with pytest.raises(ModelLoadError, match="^unsupported architecture: mamba$"):
        hf_config_from_metadata({"general.architecture": "mamba"}, [])
    with pytest.raises(ModelLoadError, match="lacks general.architecture"):
        hf_config_from_metadata({}, [])


def test_vocab_size_falls_back_to_metadata_key() -> None:
    md = gemma3_metadata(6)
    del md["tokenizer.ggml.tokens"]
    md["gemma3.vocab_size"] = 77
    assert hf_config_from_metadata(md, [])["vocab_size"] == 77
