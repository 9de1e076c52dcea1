"""The bundled real files against transformers reading the same .gguf.

SmolLM2 (Llama, Q4_1): every tensor load_gguf returns equals, bit for bit, the state dict of
`AutoModelForCausalLM.from_pretrained(dir, gguf_file=..., dtype=float32)` (this checks names, the
Q/K unpermutation and dequantization together), and the config matches.

Gemma 3 270M: loading it through transformers costs ~60 s and 4 GB, so the check is narrower:
every tensor's HF name equals the name transformers' own GGUF name map gives it, and the values of
a sliding layer (0), a global layer (5) and the final norm equal transformers' processing of the
same tensors (gguf's numpy dequantization, then its Gemma norm shift). The config matches the one
transformers builds from the file, including the fields the file omits (layer pattern, local rope
base, query_pre_attn_scalar), where transformers' Gemma 3 defaults apply.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedConfig

from freetoken.weights.gguf import GGUFCheckpoint, load_gguf
from freetoken.weights.gguf_config import hf_config_from_metadata
from freetoken.weights.gguf_metadata import metadata_of, open_gguf
from freetoken.weights.names import HFTensorAssembler, hf_target
from freetoken.weights.dequant import dequantize

pytestmark = pytest.mark.real_model

CONFIG_KEYS = [
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings",
    "rope_parameters", "bos_token_id", "eos_token_id", "pad_token_id", "attention_bias",
]  # fmt: skip


def torch_shape(t: gguf.ReaderTensor) -> tuple[int, ...]:
    return tuple(int(x) for x in reversed(t.shape.tolist()))


def assert_config_agrees(got: dict[str, object], ref: PreTrainedConfig, extra: list[str]) -> None:
    assert got["model_type"] == ref.model_type
    built = AutoConfig.for_model(**got)
    assert type(built) is type(ref)
    for key in CONFIG_KEYS + extra:
        assert getattr(built, key) == getattr(ref, key), key


@pytest.fixture(scope="session")
def smollm2_checkpoint(smollm2_gguf: Path) -> GGUFCheckpoint:
    return load_gguf(smollm2_gguf)


@pytest.fixture(scope="session")
def smollm2_transformers(
    smollm2_gguf: Path, transformers_gguf: Callable[[Path], torch.nn.Module]
) -> tuple[dict[str, torch.Tensor], PreTrainedConfig]:
    model = transformers_gguf(smollm2_gguf)  # AutoModelForCausalLM.from_pretrained(..., gguf_file=...), float32
    return model.state_dict(), model.config


def test_smollm2_every_tensor_matches_transformers(
    smollm2_checkpoint: GGUFCheckpoint, smollm2_transformers: tuple[dict[str, torch.Tensor], PreTrainedConfig]
) -> None:
    ref, _ = smollm2_transformers
    ours = smollm2_checkpoint.tensors
    assert set(ref) - set(ours) == {"lm_head.weight"}  # tied: the file has no output.weight
    assert set(ours) <= set(ref)
    for name, t in ours.items():
        assert t.dtype == torch.float32 and t.shape == ref[name].shape, name
        assert torch.equal(t, ref[name]), name


def test_smollm2_config_and_quant_types(
    smollm2_checkpoint: GGUFCheckpoint, smollm2_transformers: tuple[dict[str, torch.Tensor], PreTrainedConfig]
) -> None:
    _, ref = smollm2_transformers
    cfg = smollm2_checkpoint.hf_config
    assert_config_agrees(cfg, ref, ["hidden_act", "mlp_bias"])
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["tie_word_embeddings"] is True
    assert cfg["layer_types"] == ["full_attention"] * 30 and cfg["sliding_window"] is None
    assert smollm2_checkpoint.quant_types == {"Q8_0": 1, "F32": 61, "Q4_1": 210}
    assert smollm2_checkpoint.metadata["general.architecture"] == "llama"


@pytest.fixture(scope="session")
def gemma_transformers_config(gemma_gguf: Path, gemma_reader: gguf.GGUFReader) -> PreTrainedConfig:
    # transformers opens the file with gguf.GGUFReader too; hand it the session's already-parsed
    # reader instead of paying gguf's ~12 s vocabulary parse a second time.
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "GGUFReader", lambda path: gemma_reader)
        return AutoConfig.from_pretrained(gemma_gguf.parent, gguf_file=gemma_gguf.name)


@pytest.fixture(scope="session")
def gemma_config(gemma_gguf: Path) -> dict[str, object]:
    reader = open_gguf(gemma_gguf)
    return hf_config_from_metadata(metadata_of(reader), [t.name for t in reader.tensors])


def test_gemma_config_matches_transformers(gemma_config: dict[str, object], gemma_transformers_config: PreTrainedConfig) -> None:
    extra = ["layer_types", "sliding_window", "query_pre_attn_scalar", "hidden_activation",
             "final_logit_softcapping", "attn_logit_softcapping"]  # fmt: skip
    assert_config_agrees(gemma_config, gemma_transformers_config, extra)
    # the rule for what the file omits, spelled out
    full = [i for i, kind in enumerate(gemma_config["layer_types"]) if kind == "full_attention"]  # type: ignore[arg-type]
    assert full == [5, 11, 17] and len(gemma_config["layer_types"]) == 18  # type: ignore[arg-type]
    assert gemma_config["rope_parameters"] == {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
    }
    assert gemma_config["query_pre_attn_scalar"] == gemma_config["head_dim"] == 256
    assert gemma_config["final_logit_softcapping"] is None and gemma_config["attn_logit_softcapping"] is None
    assert gemma_config["sliding_window"] == 512 and gemma_config["vocab_size"] == 262144
    assert gemma_config["max_position_embeddings"] == 32768
    assert (gemma_config["bos_token_id"], gemma_config["eos_token_id"]) == (2, 1)
    assert gemma_config["tie_word_embeddings"] is True


def test_gemma_names_match_transformers_name_map(
    gemma_reader: gguf.GGUFReader, gemma_transformers_config: PreTrainedConfig
) -> None:
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, get_gguf_hf_weights_map

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(gemma_transformers_config)
    ref_map = get_gguf_hf_weights_map(model, TENSOR_PROCESSORS["gemma3"]())
    for t in gemma_reader.tensors:
        target = hf_target("gemma3", t.name)
        assert target is not None and target.part is None
        assert target.hf_name == ref_map[t.name], t.name


def test_gemma_sample_layers_match_transformers_processing(gemma_reader: gguf.GGUFReader) -> None:
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS

    processor = TENSOR_PROCESSORS["gemma3"]()
    chosen = [t for t in gemma_reader.tensors if t.name.startswith(("blk.0.", "blk.5.")) or t.name == "output_norm.weight"]
    assert len(chosen) == 2 * 13 + 1
    assembler = HFTensorAssembler("gemma3", num_attention_heads=4, num_key_value_heads=1)
    for t in chosen:
        assembler.add(t.name, dequantize(t.data, t.tensor_type, torch_shape(t), t.name))
    ours = assembler.finish()
    shifted = 0
    for t in chosen:
        ref = processor.process(weights=gguf.quants.dequantize(t.data, t.tensor_type), name=t.name).weights
        ref_t = torch.from_numpy(np.array(ref, dtype=np.float32)).reshape(torch_shape(t))
        got = ours[hf_target("gemma3", t.name).hf_name]  # type: ignore[union-attr]
        assert torch.equal(got, ref_t), t.name
        shifted += t.name.endswith("norm.weight")
    assert shifted == 2 * 6 + 1  # four block norms and q/k norms per layer, plus the final norm
