"""Packed MoE experts (models/experts.py) and expert offload (models/experts_cache.py).

A tiny random gpt-oss (4 experts, top 2) is written with MXFP4 experts, as HF safetensors
(`*_blocks` / `*_scales`) and as a GGUF file (MXFP4 and Q8_0 stacks, laid out as llama.cpp
writes them). Packed, its logits equal those of a float twin whose experts hold the dequantized
values (transformers' own MXFP4 decoder for the safetensors layout, our GGUF decoder for the
file) within 3% relative error: the qlinear kernel rounds activations to int8, nothing else
differs. `--moe-strategy offload` with a cache of less than a layer's experts gives the same
greedy tokens as resident, with misses and evictions counted.
"""

from __future__ import annotations

import gc
import json
import shutil
import sys
import weakref
from pathlib import Path

import gguf
import pytest
import torch
from model_harness import GPT_OSS, chunked_last_logits, make_reference, paged_greedy
from safetensors.torch import save_file
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from freetoken.models.experts import expert_cache, expert_status, experts_of, offload_experts
from freetoken.models.experts_cache import TRIM_BYTES, ExpertCache
from freetoken.models.inspect import _param_count, weight_kinds
from freetoken.models.registry import CausalLM, build_model, config_from_hf
from freetoken.ops.qlinear import PackedWeight
from freetoken.ops.quantized import dequantize, quantize_int8
from freetoken.weights.dequant import Deferred, mxfp4_float, mxfp4_q, mxfp4_to_int8
from freetoken.weights.gguf import load_gguf
from freetoken.weights.safetensors import load_safetensors_dir

sys.path.insert(0, str(Path(__file__).parents[1] / "unit" / "weights"))
from gguf_writing import np32, write_gguf

IDS = [3, 17, 250, 9, 44, 101, 7, 63, 12, 200, 5]
TOLERANCE = 0.03
E2M1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])


def to_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., N, K] floats -> HF MXFP4 (blocks uint8 [..., N, K / 32, 16], scales uint8 [..., N, K / 32])."""
    g = w.float().reshape(*w.shape[:-1], w.shape[-1] // 32, 32)
    amax = g.abs().amax(dim=-1).clamp_min(2.0**-20)
    e = (torch.ceil(torch.log2(amax / 6)) + 127).clamp(110, 135)  # values / 2^(e - 127) within +-6
    scaled = g / torch.exp2(e - 127).unsqueeze(-1)
    codes = (scaled.unsqueeze(-1) - E2M1).abs().argmin(dim=-1).to(torch.uint8)  # [..., G, 32]
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)  # element 2j low nibble, 2j + 1 high
    return blocks, e.to(torch.uint8)


def load(tensors: dict, config: dict, weights: str = "auto", cache: ExpertCache | None = None) -> CausalLM:
    model = build_model(config_from_hf(config), torch.float32, "cpu")
    if cache is not None:
        offload_experts(model, cache)
    model.load_weights(dict(tensors), weights)  # load_weights empties the mapping it is given
    return model


def last_logits(model: CausalLM) -> torch.Tensor:
    return chunked_last_logits(model, IDS)


def greedy(model: CausalLM, n: int) -> list[int]:
    return paged_greedy(model, IDS[:6], n)


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    directory = tmp_path_factory.mktemp("gpt_oss")
    make_reference("gpt_oss", directory)
    return directory, json.loads((directory / "config.json").read_text())


@pytest.fixture(scope="module")
def mxfp4(reference: tuple[Path, dict]) -> tuple[dict, dict]:
    """(MXFP4 tensors as HF stores them, float tensors with those experts dequantized by transformers)."""
    directory, _ = reference
    sd = load_safetensors_dir(directory, dtype=torch.float32)
    packed, twin = dict(sd), dict(sd)
    for i in range(GPT_OSS["num_hidden_layers"]):
        for proj in ("gate_up_proj", "down_proj"):
            name = f"model.layers.{i}.mlp.experts.{proj}"
            blocks, scales = to_mxfp4(packed.pop(name).transpose(1, 2))  # HF stores [E, out, in / 32, 16]
            packed[name + "_blocks"], packed[name + "_scales"] = blocks, scales
            twin[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, in, out]
    return packed, twin


def test_mxfp4_to_int8_is_exact_and_refuses_what_float16_cannot_hold() -> None:
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (8, 2, 32), generator=g, dtype=torch.uint8)  # [N, G, 32] in element order
    exps = torch.randint(104, 141, (8, 2), generator=g, dtype=torch.uint8)
    hf_blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)  # HF: element 2j low nibble, 2j + 1 high
    gguf_blocks = codes[..., :16] | (codes[..., 16:] << 4)  # GGUF: element j low nibble, j + 16 high
    q = mxfp4_q(hf_blocks, interleaved=True)
    assert torch.equal(q, mxfp4_q(gguf_blocks, interleaved=False))
    hf_values = convert_moe_packed_tensors(hf_blocks[None], exps[None], dtype=torch.float32)[
        0
    ].t()  # [1, K, N] -> [N, K]
    assert torch.equal(mxfp4_float(q, exps), hf_values)
    qw = mxfp4_to_int8(q, exps)
    assert qw is not None and qw.bits == 8 and int(qw.q.min()) >= 0 and int(qw.q.max()) <= 24
    assert torch.equal(dequantize(qw), hf_values)
    exps[3, 1] = 141  # 12 * 2^13 overflows float16's minimum
    assert mxfp4_to_int8(q, exps) is None
    exps[3, 1], exps[4, 0] = 103, 255
    hf_blocks[3, 1], hf_blocks[4, 0] = 0x88, 0  # ... unless those blocks are all zeros (code 8 is -0)
    q = mxfp4_q(hf_blocks, interleaved=True)
    qw = mxfp4_to_int8(q, exps)
    assert qw is not None and float(qw.scale[3, 1]) == 0 and torch.equal(dequantize(qw)[3, 32:], torch.zeros(32))


def test_mxfp4_safetensors_experts_stay_packed(reference: tuple[Path, dict], mxfp4: tuple[dict, dict]) -> None:
    _, config = reference
    packed_tensors, twin_tensors = mxfp4
    model, twin = load(dict(packed_tensors), config), load(dict(twin_tensors), config)
    assert {x.runs_as() for x in experts_of(model)} == {"int8 (group 32)"}
    assert {x.runs_as() for x in experts_of(twin)} == {"float32"}
    err = relative(last_logits(model), last_logits(twin))
    assert 0 < err < TOLERANCE, f"packed MXFP4 experts {err:.4f} from the dequantized reference"


def write_gpt_oss_gguf(path: Path, sd: dict, config: dict, qtype: gguf.GGMLQuantizationType) -> Path:
    """The tiny gpt-oss as llama.cpp lays it out, its expert stacks in `qtype`, the rest float32."""
    tensors: dict = {
        "token_embd.weight": np32(sd["model.embed_tokens.weight"]),
        "output_norm.weight": np32(sd["model.norm.weight"]),
        "output.weight": np32(sd["lm_head.weight"]),
    }
    names = {
        "attn_norm.weight": "input_layernorm.weight",
        "post_attention_norm.weight": "post_attention_layernorm.weight",
        "attn_sinks.weight": "self_attn.sinks",
        "ffn_gate_inp.weight": "mlp.router.weight",
        "ffn_gate_inp.bias": "mlp.router.bias",
        "ffn_down_exps.bias": "mlp.experts.down_proj_bias",
    }
    names |= {
        f"attn_{g}.{k}": f"self_attn.{h}_proj.{k}"
        for g, h in (("q", "q"), ("k", "k"), ("v", "v"), ("output", "o"))
        for k in ("weight", "bias")
    }
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors |= {f"blk.{i}.{g}": np32(sd[p + h]) for g, h in names.items()}
        gate_up = sd[p + "mlp.experts.gate_up_proj"].transpose(1, 2)  # [E, 2I, H], gate rows even
        bias = sd[p + "mlp.experts.gate_up_proj_bias"]
        stacks = {
            "gate": gate_up[:, 0::2],
            "up": gate_up[:, 1::2],
            "down": sd[p + "mlp.experts.down_proj"].transpose(1, 2),
        }
        for proj, w in stacks.items():
            raw = gguf.quants.quantize(np32(w), qtype)  # [E, N, K * type_size / 32] bytes
            tensors[f"blk.{i}.ffn_{proj}_exps.weight"] = (raw, qtype)
        tensors[f"blk.{i}.ffn_gate_exps.bias"] = np32(bias[:, 0::2])
        tensors[f"blk.{i}.ffn_up_exps.bias"] = np32(bias[:, 1::2])
    kv = {
        "block_count": config["num_hidden_layers"],
        "context_length": config["max_position_embeddings"],
        "embedding_length": config["hidden_size"],
        "attention.head_count": config["num_attention_heads"],
        "attention.head_count_kv": config["num_key_value_heads"],
        "attention.layer_norm_rms_epsilon": config["rms_norm_eps"],
        "feed_forward_length": config["intermediate_size"],
        "expert_feed_forward_length": config["intermediate_size"],
        "expert_count": config["num_local_experts"],
        "expert_used_count": config["num_experts_per_tok"],
        "attention.key_length": 16,
        "attention.value_length": 16,
        "attention.sliding_window": config["sliding_window"],
        "rope.freq_base": 1000.0,
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": [f"t{i}" for i in range(300)],
    }
    return write_gguf(path, "gpt-oss", kv, tensors)


@pytest.fixture(scope="module", params=["MXFP4", "Q8_0"])
def gguf_file(
    request: pytest.FixtureRequest, reference: tuple[Path, dict], tmp_path_factory: pytest.TempPathFactory
) -> Path:
    directory, config = reference
    sd = load_safetensors_dir(directory, dtype=torch.float32)
    qtype = gguf.GGMLQuantizationType[request.param]
    return write_gpt_oss_gguf(tmp_path_factory.mktemp("gguf") / f"{request.param}.gguf", sd, config, qtype)


def test_gguf_expert_stacks_stay_packed(gguf_file: Path) -> None:
    packed, floats = load_gguf(gguf_file, keep_quantized=True), load_gguf(gguf_file, keep_quantized=False)
    stack = packed.tensors["model.layers.0.mlp.experts.gate_proj"]
    assert isinstance(stack, list) and len(stack) == 4 and all(isinstance(d, Deferred) for d in stack)
    model, twin = load(packed.tensors, packed.hf_config), load(floats.tensors, floats.hf_config)
    assert {x.runs_as() for x in experts_of(model)} == {"int8 (group 32)"}
    err = relative(last_logits(model), last_logits(twin))
    assert 0 < err < TOLERANCE, f"{gguf_file.stem} packed experts {err:.4f} from the dequantized reference"


def test_offload_smaller_than_the_experts_matches_resident(gguf_file: Path) -> None:
    ck = load_gguf(gguf_file, keep_quantized=True)
    resident = load(dict(ck.tensors), ck.hf_config)
    one_layer = sum(w.nbytes for x in experts_of(resident)[:1] for w in (*x.gate_up, *x.down))
    cache = ExpertCache(one_layer // 2)  # two of a layer's four experts
    offloaded = load(dict(ck.tensors), ck.hf_config, cache=cache)
    assert expert_cache(offloaded) is cache and cache.misses == 0 and cache.bytes == 0  # nothing decoded at load
    assert greedy(offloaded, 8) == greedy(resident, 8)
    assert cache.misses > 0 and cache.evictions > 0 and cache.hits + cache.misses >= 8 * 2 * 2
    assert cache.bytes <= cache.capacity_bytes
    status = expert_status(offloaded)
    assert status is not None and status["strategy"] == "offload" and status["cache"]["misses"] == cache.misses
    assert expert_status(resident) == {"strategy": "resident", "experts": 8, "resident_bytes": 2 * one_layer}


def test_offload_of_float_safetensors_matches_resident(reference: tuple[Path, dict]) -> None:
    directory, config = reference
    sd = load_safetensors_dir(directory, dtype=torch.float32)
    cache = ExpertCache(1)  # every lookup a miss: each expert decoded from the host copy when routed to
    assert greedy(load(dict(sd), config, "int8", cache=cache), 6) == greedy(load(dict(sd), config, "int8"), 6)
    assert cache.hits == 0 and cache.misses >= 6 * 2 * 2 and len(cache) == 1


def test_expert_cache_is_lru_within_its_budget() -> None:
    cache, built = ExpertCache(30), []

    def build(key: str) -> tuple[str, int]:
        built.append(key)
        return key.upper(), 10

    for key in ["a", "b", "c", "a", "d"]:  # d evicts b, the least recently used
        assert cache.get(key, lambda key=key: build(key)) == key.upper()
    assert built == ["a", "b", "c", "d"] and (cache.hits, cache.misses, cache.evictions) == (1, 4, 1)
    cache.get("b", lambda: build("b"))  # a miss again; c goes
    assert built[-1] == "b" and cache.bytes == 30 and cache.loaded_bytes == 50
    assert cache.resize(10) == 20 and len(cache) == 1 and cache.evictions == 4
    cache.get("b", lambda: build("b"))
    assert cache.hits == 2  # b, the most recent, survived the shrink
    big = cache.get("x", lambda: ("X", 25))  # larger than the budget: held alone until the next miss
    assert big == "X" and len(cache) == 1 and cache.bytes == 25
    with pytest.raises(ValueError):
        cache.resize(-1)
    assert cache.status()["hit_rate"] == pytest.approx(2 / 8)


def test_evicted_experts_are_freed_at_eviction() -> None:
    """An evicted expert's packed matrices are freed when the cache drops them (no reference cycle
    waits for the collector), across the trims that give the heap back after TRIM_BYTES[0]."""
    gc.disable()  # nothing may depend on the collector
    try:
        cache, refs = ExpertCache(TRIM_BYTES[0] // 4), []
        for key in range(8):
            entry = tuple(PackedWeight.from_quantized(quantize_int8(torch.randn(32, 64))) for _ in range(2))
            refs.append([weakref.ref(p) for p in entry])
            cache.get(key, lambda entry=entry: (entry, TRIM_BYTES[0] // 4))
            del entry
        assert cache.evictions == 7 and all(r() is not None for r in refs[-1])
        assert all(r() is None for rs in refs[:7] for r in rs)
    finally:
        gc.enable()


def test_inspect_lists_the_experts_and_counts_their_parameters(reference: tuple[Path, dict]) -> None:
    directory, config = reference
    model = load(load_safetensors_dir(directory, dtype=torch.float32), config, "int4")
    assert "  layers.*.mlp.experts         int4 (group 32)  x2   [4, 32, 64]" in weight_kinds(model)
    hf = make_reference("gpt_oss", directory / "again")
    assert _param_count(model) == sum(p.numel() for p in hf.parameters())


def test_offload_must_come_before_loading(reference: tuple[Path, dict]) -> None:
    directory, config = reference
    model = load(load_safetensors_dir(directory, dtype=torch.float32), config)
    with pytest.raises(Exception, match="before the experts are loaded"):
        offload_experts(model, ExpertCache(1 << 20))


def mapped_from(t: torch.Tensor, path: Path) -> bool:
    """Whether t's data lies in a mapping of the file at `path` (/proc/self/maps)."""
    ptr = t.data_ptr()
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split()
        if len(fields) >= 6 and fields[5] == str(path.resolve()):
            lo, hi = (int(v, 16) for v in fields[0].split("-"))
            if lo <= ptr < hi:
                return True
    return False


def test_copy_of_reference_directory_loads_mxfp4_from_disk(
    reference: tuple[Path, dict], mxfp4: tuple[dict, dict], tmp_path: Path
) -> None:
    """The MXFP4 tensors survive a real safetensors file (uint8 is not cast to the model dtype) and
    are views of its memory map, the backing store of offloaded experts."""
    directory, config = reference
    shutil.copy(directory / "config.json", tmp_path / "config.json")
    save_file({k: v.contiguous() for k, v in mxfp4[0].items()}, str(tmp_path / "model.safetensors"))
    tensors = load_safetensors_dir(tmp_path, dtype=torch.float32)
    blocks = tensors["model.layers.0.mlp.experts.down_proj_blocks"]
    assert blocks.dtype == torch.uint8 and mapped_from(blocks, tmp_path / "model.safetensors")  # no copy in RAM
    from_disk = load(tensors, config)
    assert {x.runs_as() for x in experts_of(from_disk)} == {"int8 (group 32)"}
    assert torch.equal(last_logits(from_disk), last_logits(load(dict(mxfp4[0]), config)))
