"""GLM-4.5 MoE (`glm4_moe`) through the engine against transformers' greedy tokens, from the tiny
safetensors checkpoint (`tiny_models.py`, with an MTP layer as GLM-4.5's checkpoints hold) and
from the GGUF file llama.cpp's own `convert_hf_to_gguf.py` writes of it (`--outtype f32`, MTP
block kept, as the converter does by default): the file gives the checkpoint's tensors and config
back (the MTP block under the checkpoint's names), and the same tokens.

The converter's BPE pre-tokenizer check and GLM vocabulary (`[gMASK]`, `<|user|>`, ...) do not
know the tiny test vocabulary, so the check is answered `qwen2` and the vocabulary written as a
plain GPT-2 one (only the tokenizer metadata depends on either). Skipped where the converter is
not present."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

from freetoken.llm import LLM
from freetoken.models.registry import config_from_hf
from freetoken.request import SamplingParams
from freetoken.weights.gguf import load_gguf
from freetoken.weights.safetensors import load_safetensors_dir

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_glm4_moe_parity import add_mtp_layer  # noqa: E402
from test_qwen3_5_gguf import stacked  # noqa: E402
from tiny_models import write_tiny_model  # noqa: E402

LLAMA_CPP = Path("/root/.cache/freetoken/llama.cpp/src/llama_cpp_python-0.3.36/vendor/llama.cpp")
CONVERT = """
import runpy, sys
root = sys.argv[1]
sys.path[:0] = [root, root + "/gguf-py"]
import conversion.base as base
for cls in vars(base).values():
    if isinstance(cls, type) and "get_vocab_base_pre" in vars(cls):
        cls.get_vocab_base_pre = lambda self, tokenizer: "qwen2"
    if isinstance(cls, type) and "_set_vocab_glm" in vars(cls):
        cls._set_vocab_glm = cls._set_vocab_gpt2
sys.argv = ["convert_hf_to_gguf.py", *sys.argv[2:]]
runpy.run_path(root + "/convert_hf_to_gguf.py", run_name="__main__")
"""
PROMPTS = [list(range(3, 40)), list(range(3, 20)) + [7, 9, 11], [5, 6, 7], list(range(50, 120, 3))]
NEW = 6
PARAMS = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = write_tiny_model("glm4_moe", Path(tmp_path_factory.mktemp("glm4_moe")) / "hf")
    add_mtp_layer(directory)
    return directory


@pytest.fixture(scope="module")
def want(checkpoint: Path) -> list[list[int]]:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        checkpoint, dtype=torch.float64, attn_implementation="eager"
    )
    model.config._experts_implementation = "eager"
    out = []
    for p in PROMPTS:
        gen = model.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
        out.append(gen[0, len(p) :].tolist())
    return out


@pytest.fixture(scope="module")
def converted(checkpoint: Path) -> Path:
    if not (LLAMA_CPP / "convert_hf_to_gguf.py").exists():
        pytest.skip("llama.cpp's convert_hf_to_gguf.py is not present")
    out = checkpoint.parent / "model.gguf"
    args = [str(LLAMA_CPP), str(checkpoint), "--outfile", str(out), "--outtype", "f32"]
    subprocess.run([sys.executable, "-c", CONVERT, *args], check=True, capture_output=True, timeout=300)
    return out


@pytest.mark.parametrize("chunk", [5, 64])
def test_batched_chunked_greedy_equals_transformers(checkpoint: Path, want: list[list[int]], chunk: int) -> None:
    """Four prompts of 3 to 37 tokens at once, prefill chunks of `chunk` tokens (5: chunks end
    mid-page, batched with others' decode rows)."""
    llm = LLM(str(checkpoint), dtype="float64", page_size=4, max_prefill_length=chunk, num_tokens=1024,
              debug_kv=True, threads=1)  # fmt: skip
    got = llm.generate(PROMPTS, PARAMS)
    assert [o.token_ids for o in got] == want
    assert llm.engine.kv.audit(idle=True).ok


def test_gguf_gives_the_checkpoint_back(checkpoint: Path, converted: Path) -> None:
    ck = load_gguf(converted, dtype=torch.float64)
    sd = stacked(load_safetensors_dir(checkpoint, dtype=torch.float64))
    assert set(ck.tensors) == set(sd)  # the MTP block (blk.3) too, under the checkpoint's names
    for name, value in sd.items():
        torch.testing.assert_close(ck.tensors[name], value, atol=1e-6, rtol=1e-6, msg=name)
    assert ck.hf_config["num_hidden_layers"] == 3 and ck.hf_config["num_nextn_predict_layers"] == 1
    got, want = config_from_hf(ck.hf_config), config_from_hf(json.loads((checkpoint / "config.json").read_text()))
    for field in ("num_layers", "head_dim", "num_kv_heads", "attention_bias", "o_proj_bias", "rope_full", "num_experts",
                  "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size", "norm_topk_prob",
                  "dense_mlp_layers", "n_group", "topk_group", "routed_scaling_factor", "qk_norm",
                  "tie_word_embeddings", "intermediate_size"):  # fmt: skip
        assert getattr(got, field) == getattr(want, field), field


def test_gguf_greedy_tokens_equal_transformers(converted: Path, want: list[list[int]]) -> None:
    llm = LLM(str(converted), dtype="float64", page_size=4, max_prefill_length=16, num_tokens=1024, debug_kv=True,
              threads=1)  # fmt: skip
    got = llm.generate(PROMPTS, PARAMS)
    assert [o.token_ids for o in got] == want


def test_offloaded_experts_give_the_resident_tokens(converted: Path) -> None:
    """`--moe-strategy offload` with a cache of about 2 of a layer's 8 experts (evicting every step)
    gives the resident model's greedy tokens."""
    from freetoken.models.experts import expert_cache
    from freetoken.models.load import load_model
    from model_harness import paged_greedy

    cpu = torch.device("cpu")
    resident = load_model(str(converted), torch.float32, cpu, "auto")
    offloaded = load_model(str(converted), torch.float32, cpu, "auto", moe_strategy="offload", expert_cache_gb=5e-5)
    prompt = list(range(3, 30))
    assert paged_greedy(offloaded.model, prompt, 8) == paged_greedy(resident.model, prompt, 8)
    cache = expert_cache(offloaded.model)
    assert cache is not None and cache.misses > 2 * 8  # more decodes than the experts: evictions happened


def test_preflight_reads_the_context_and_no_window(checkpoint: Path, converted: Path) -> None:
    """`ft serve`'s API process (no torch) knows the family: its context from config.json or the
    GGUF, Glm4MoeConfig's 131072 where config.json leaves it out, and no sliding-window layers."""
    from freetoken.server.preflight import ModelFacts, facts_from_gguf, facts_from_hf
    from freetoken.weights.gguf_metadata import read_metadata

    config = json.loads((checkpoint / "config.json").read_text())
    assert facts_from_hf(config) == facts_from_gguf(read_metadata(converted)) == ModelFacts(1024, None)
    assert facts_from_hf({k: v for k, v in config.items() if k != "max_position_embeddings"}).context_length == 131_072
