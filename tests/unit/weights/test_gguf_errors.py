"""Bad GGUF input: each case is one ModelLoadError whose single-line message says what is wrong."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf_writing import write_gguf

from freetoken.errors import ModelLoadError
from freetoken.weights.gguf import load_gguf

LLAMA_KV: dict[str, object] = {
    "block_count": 1, "context_length": 64, "embedding_length": 256, "feed_forward_length": 256,
    "attention.head_count": 2, "attention.layer_norm_rms_epsilon": 1e-5,
    "tokenizer.ggml.tokens": [f"t{i}" for i in range(8)],
}  # fmt: skip


def load_error(path: Path) -> str:
    with pytest.raises(ModelLoadError) as info:
        load_gguf(path)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_missing_file(tmp_path: Path) -> None:
    assert "model file not found" in load_error(tmp_path / "nope.gguf")


def test_truncated_real_file(tmp_path: Path, smollm2_gguf: Path) -> None:
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(smollm2_gguf.read_bytes()[:1024])
    message = load_error(cut)
    assert str(cut) in message and "not a readable GGUF file" in message


def test_not_a_gguf_file(tmp_path: Path) -> None:
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"PK\x03\x04" + bytes(4096))
    assert "not a readable GGUF file" in load_error(junk)


def test_tensor_data_cut_short(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "short.gguf", "llama", LLAMA_KV, {"token_embd.weight": np.ones((8, 256), np.float32)})
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 4096])
    assert "not a readable GGUF file" in load_error(path)


def test_unsupported_architecture(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "mamba.gguf", "mamba", {"block_count": 1}, {"token_embd.weight": np.ones((8, 16), np.float32)})
    message = load_error(path)
    assert message.endswith("unsupported architecture: mamba")


def test_unsupported_quant_type(tmp_path: Path) -> None:
    qtype = gguf.GGMLQuantizationType.IQ2_XXS
    _, type_size = gguf.GGML_QUANT_SIZES[qtype]
    raw = np.zeros((256, type_size), dtype=np.uint8)  # 256 rows of one 256-element block
    tensors = {"token_embd.weight": np.ones((8, 256), np.float32), "blk.0.attn_q.weight": (raw, qtype)}
    path = write_gguf(tmp_path / "iq2.gguf", "llama", LLAMA_KV, tensors)
    message = load_error(path)
    assert "unsupported quant type IQ2_XXS for tensor blk.0.attn_q.weight" in message


def test_unknown_tensor_name(tmp_path: Path) -> None:
    tensors = {"token_embd.weight": np.ones((8, 256), np.float32), "blk.0.mystery.weight": np.ones(4, np.float32)}
    path = write_gguf(tmp_path / "odd.gguf", "llama", LLAMA_KV, tensors)
    assert "unexpected tensor blk.0.mystery.weight" in load_error(path)


def test_missing_metadata_key(tmp_path: Path) -> None:
    kv = {k: v for k, v in LLAMA_KV.items() if k != "embedding_length"}
    path = write_gguf(tmp_path / "nokey.gguf", "llama", kv, {"token_embd.weight": np.ones((8, 256), np.float32)})
    assert "GGUF metadata lacks llama.embedding_length" in load_error(path)


def test_gpt_oss_expert_half_missing(tmp_path: Path) -> None:
    kv = LLAMA_KV | {"expert_count": 2, "expert_used_count": 1, "attention.key_length": 128, "attention.sliding_window": 4}
    tensors = {"blk.0.ffn_gate_exps.weight": np.ones((2, 4, 256), np.float32)}
    path = write_gguf(tmp_path / "half.gguf", "gpt-oss", kv, tensors)
    assert "only one of the gate / up expert tensors" in load_error(path)
