"""Qwen3.5, Qwen3.5-MoE and Qwen3-Next from a GGUF file written by llama.cpp's own `convert_hf_to_gguf.py`
(the `qwen35` / `qwen35moe` / `qwen3next` architectures, `--outtype f32 --no-mtp`) from the tiny checkpoints of
`tiny_models.py`: the file gives the checkpoint's tensors and config back (norms un-shifted,
A_log from `ssm_a`, the value heads un-tiled), and the engine gives transformers' greedy tokens.
The converter's BPE pre-tokenizer check does not know the tiny test vocabulary, so it is answered
`qwen2` (only the tokenizer metadata depends on it). Skipped where the converter is not present.
The same file rewritten by llama.cpp's `llama-quantize` (COPY: the tensors as they are, but a
[1, H] gate stored as [H], as in every quantized Qwen3.5-MoE file) gives the checkpoint back too."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

from freetoken.llm import LLM
from freetoken.models.registry import CausalLM, build_model, config_from_hf
from freetoken.ops.superblock import PackedColumns
from freetoken.request import SamplingParams
from freetoken.weights.gguf import load_gguf
from freetoken.weights.safetensors import load_safetensors_dir

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_models import write_tiny_model  # noqa: E402
from model_harness import chunked_last_logits  # noqa: E402

LLAMA_CPP = Path("/root/.cache/freetoken/llama.cpp/src/llama_cpp_python-0.3.36/vendor/llama.cpp")
LLAMA_QUANTIZE = Path("/root/.cache/freetoken/llama.cpp/build/bin/llama-quantize")
CONVERT = """
import runpy, sys
root = sys.argv[1]
sys.path[:0] = [root, root + "/gguf-py"]
import conversion.base as base
for cls in vars(base).values():
    if isinstance(cls, type) and "get_vocab_base_pre" in vars(cls):
        cls.get_vocab_base_pre = lambda self, tokenizer: "qwen2"
sys.argv = ["convert_hf_to_gguf.py", *sys.argv[2:]]
runpy.run_path(root + "/convert_hf_to_gguf.py", run_name="__main__")
"""
PROMPTS = [list(range(3, 40)), [5, 6, 7]]
NEW = 6


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_5_moe", "qwen3_next"])
def converted(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    if not (LLAMA_CPP / "convert_hf_to_gguf.py").exists():
        pytest.skip("llama.cpp's convert_hf_to_gguf.py is not present")
    # llama.cpp's qwen3next has no dense layers: the tiny Qwen3-Next's one is made an MoE here
    overrides = {"mlp_only_layers": []} if request.param == "qwen3_next" else {}
    directory = write_tiny_model(request.param, Path(tmp_path_factory.mktemp(request.param)) / "hf", **overrides)
    out = directory.parent / "model.gguf"
    args = [str(LLAMA_CPP), str(directory), "--outfile", str(out), "--outtype", "f32", "--no-mtp"]
    subprocess.run([sys.executable, "-c", CONVERT, *args], check=True, capture_output=True, timeout=300)
    return directory, out


def stacked(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The hub's per-expert matrices (`...experts.{e}.gate_proj.weight`) as transformers' stacks
    `gate_up_proj` [E, 2I, H] (gate rows first) and `down_proj` [E, H, I], as the GGUF gives them."""
    out = {n: t for n, t in sd.items() if ".experts." not in n}
    prefixes = sorted({n.split("experts.")[0] + "experts." for n in sd if ".experts." in n})
    for p in prefixes:
        n = len({k for k in sd if k.startswith(p) and k.endswith("down_proj.weight")})
        gate, up, down = ([sd[f"{p}{e}.{w}_proj.weight"] for e in range(n)] for w in ("gate", "up", "down"))
        out[p + "gate_up_proj"] = torch.stack([torch.cat([g, u]) for g, u in zip(gate, up)])
        out[p + "down_proj"] = torch.stack(down)
    return out


def unfused(sd: dict[str, torch.Tensor], directory: Path) -> dict[str, torch.Tensor]:
    """Qwen3-Next's fused linear-layer projections split as the model splits them at load (the
    GGUF holds q/k/v and z apart, b/a fused; the checkpoint both fused); other families as they are."""
    config = config_from_hf(json.loads((directory / "config.json").read_text()))
    if config.architecture != "qwen3_next":
        return sd
    from freetoken.models.qwen3_5 import _split_fused_projections

    out = dict(sd)
    for i in config.linear_layers:
        _split_fused_projections(out, f"model.layers.{i}.linear_attn.", config)
    return out


def test_gguf_gives_the_checkpoint_back(converted: tuple[Path, Path]) -> None:
    directory, path = converted
    ck = load_gguf(path, dtype=torch.float64)
    tensors = unfused(ck.tensors, directory)
    sd = unfused(stacked(load_safetensors_dir(directory, dtype=torch.float64)), directory)
    assert set(tensors) == set(sd)
    for name, want in sd.items():
        torch.testing.assert_close(tensors[name], want, atol=1e-6, rtol=1e-6, msg=name)
    got, want = config_from_hf(ck.hf_config), config_from_hf(json.loads((directory / "config.json").read_text()))
    assert got.layer_types == want.layer_types and got.rope_full == want.rope_full
    for field in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
                  "linear_conv_kernel_dim", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
                  "shared_expert_intermediate_size", "head_dim", "num_kv_heads", "tie_word_embeddings"):  # fmt: skip
        assert getattr(got, field) == getattr(want, field), field


def test_gguf_rewritten_by_llama_quantize_gives_the_checkpoint_back(converted: tuple[Path, Path]) -> None:
    if not LLAMA_QUANTIZE.exists():
        pytest.skip("llama.cpp's llama-quantize is not built")
    directory, path = converted
    copy = path.with_name("copy.gguf")
    subprocess.run([str(LLAMA_QUANTIZE), str(path), str(copy), "COPY"], check=True, capture_output=True, timeout=300)
    ck = load_gguf(copy, dtype=torch.float64)
    tensors = unfused(ck.tensors, directory)
    sd = unfused(stacked(load_safetensors_dir(directory, dtype=torch.float64)), directory)
    assert set(tensors) == set(sd)
    for name, want in sd.items():
        torch.testing.assert_close(tensors[name], want, atol=1e-6, rtol=1e-6, msg=name)


def test_gguf_greedy_tokens_equal_transformers(converted: tuple[Path, Path]) -> None:
    directory, path = converted
    model = transformers.AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch.float64, attn_implementation="eager"
    )
    model.config._experts_implementation = "eager"
    want = [
        model.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0)[
            0, len(p) :
        ].tolist()
        for p in PROMPTS
    ]
    llm = LLM(str(path), dtype="float64", page_size=4, max_prefill_length=16, num_tokens=1024, debug_kv=True, threads=1)
    got = llm.generate(PROMPTS, SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True))
    assert [o.token_ids for o in got] == want


def test_quantized_out_proj_runs_as_the_file_stores_it(tmp_path: Path) -> None:
    """ssm_out's columns are value heads tiled across key groups: quantized to Q8_0 by
    llama-quantize (a value head of 16 columns is half a block), it stays in its integers as
    stored, the inputs gathered to its order, and the logits stay those of the same file decoded."""
    if not (LLAMA_CPP / "convert_hf_to_gguf.py").exists() or not LLAMA_QUANTIZE.exists():
        pytest.skip("llama.cpp's converter or llama-quantize is not present")
    directory = write_tiny_model("qwen3_5", tmp_path / "hf", linear_value_head_dim=16)  # 4 x 16 columns
    f32, q8 = tmp_path / "f32.gguf", tmp_path / "q8.gguf"
    args = [str(LLAMA_CPP), str(directory), "--outfile", str(f32), "--outtype", "f32", "--no-mtp"]
    subprocess.run([sys.executable, "-c", CONVERT, *args], check=True, capture_output=True, timeout=300)
    subprocess.run([str(LLAMA_QUANTIZE), str(f32), str(q8), "Q8_0"], check=True, capture_output=True, timeout=300)

    def load(keep_quantized: bool) -> CausalLM:
        ck = load_gguf(q8, keep_quantized=keep_quantized)
        model = build_model(config_from_hf(ck.hf_config), torch.float32, "cpu")
        model.load_weights(ck.tensors)
        return model

    packed, twin = load(True), load(False)
    layer = next(b.linear_attn for b in packed.layers if b.linear)
    assert isinstance(layer.out_proj.packed, PackedColumns) and layer.out_proj.runs_as() == "int8 (group 32)"
    ids = [3, 17, 50, 9, 44, 10, 7, 63, 12, 20, 5]
    got, want = chunked_last_logits(packed, ids), chunked_last_logits(twin, ids)
    err = float((got - want).norm() / want.norm())
    # every Q8_0 matrix runs with the kernel's int8 activations (measured 0.007); a wrong column
    # order would be an unrelated product
    assert err < 0.02, f"packed Q8_0 projections {err:.4f} from the dequantized ones"
