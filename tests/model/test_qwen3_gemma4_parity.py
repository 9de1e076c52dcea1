"""Qwen3, Qwen3-MoE, Gemma 4, Qwen2 and Mistral against transformers on tiny random weights, loaded both from a
safetensors directory (`save_pretrained`) and from a GGUF file laid out as llama.cpp's converter
writes it.

The shapes are the real models' in miniature: Qwen3 (tied embeddings), and with a sliding layer
(`use_sliding_window`, `max_window_layers`); Qwen3-MoE with top-k renormalised routing and one dense layer
(`mlp_only_layers`); Gemma 4 shaped like 26B-A4B (sliding and full layers with different head
dims and kv heads, `attention_k_eq_v`, an MoE beside the dense MLP, proportional rope on full
layers, soft-capping) and a dense Gemma 4 without k_eq_v; Qwen2 (q/k/v biases, o_proj none; tied,
and with a sliding layer) and Mistral (every layer sliding, window 5). Windows (5, 6) are shorter than the
19-token prompt and not multiples of the page size. The GGUF side: Qwen3 q/k rows unpermuted,
Gemma 4 norms unshifted, Qwen3-MoE experts as separate gate / up / down stacks, Gemma 4's fused
`ffn_gate_up_exps` with its router scales as `ffn_gate_inp.scale` / `ffn_down_exps.scale`.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from freetoken.models.registry import build_model, config_from_hf
from freetoken.weights.gguf import load_gguf
from model_harness import PagedRunner, Seq, load_freetoken, reference_logits

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit" / "weights"))
from gguf_writing import np32, write_gguf  # noqa: E402

VOCAB = 300
L = 19
TOL = {torch.float32: 1e-4, torch.float64: 1e-6}
ROPE = {"rope_type": "default", "rope_theta": 5000.0}
GEMMA4_ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
    "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 10_000.0},
}
CONFIGS: dict[str, tuple[type, type, dict[str, Any]]] = {
    "qwen3": (
        transformers.Qwen3Config,
        transformers.Qwen3ForCausalLM,
        dict(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=24,
            tie_word_embeddings=True,
            rope_parameters=ROPE,
        ),
    ),
    "qwen3_swa": (
        transformers.Qwen3Config,
        transformers.Qwen3ForCausalLM,
        dict(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            rope_parameters=ROPE,
            use_sliding_window=True,
            sliding_window=6,
            max_window_layers=1,
        ),
    ),
    "qwen3_moe": (
        transformers.Qwen3MoeConfig,
        transformers.Qwen3MoeForCausalLM,
        dict(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=96,
            moe_intermediate_size=32,
            num_experts=4,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            mlp_only_layers=[1],
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            rope_parameters=ROPE,
        ),
    ),
    "gemma4": (
        transformers.Gemma4TextConfig,
        transformers.Gemma4ForCausalLM,
        dict(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=5,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            global_head_dim=32,
            num_global_key_value_heads=1,
            attention_k_eq_v=True,
            sliding_window=5,
            layer_types=[
                "sliding_attention",
                "sliding_attention",
                "full_attention",
                "sliding_attention",
                "full_attention",
            ],
            hidden_size_per_layer_input=0,
            enable_moe_block=True,
            num_experts=4,
            top_k_experts=2,
            moe_intermediate_size=32,
            final_logit_softcapping=30.0,
            rope_parameters=GEMMA4_ROPE,
        ),
    ),
    "qwen2": (
        transformers.Qwen2Config,
        transformers.Qwen2ForCausalLM,
        dict(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=True,
            rope_parameters=ROPE,
        ),
    ),
    "qwen2_swa": (
        transformers.Qwen2Config,
        transformers.Qwen2ForCausalLM,
        dict(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            rope_parameters=ROPE,
            use_sliding_window=True,
            sliding_window=6,
            max_window_layers=1,
        ),
    ),
    "mistral": (
        transformers.MistralConfig,
        transformers.MistralForCausalLM,
        dict(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            rope_parameters=ROPE,
            sliding_window=5,
        ),
    ),
    "gemma4_dense": (
        transformers.Gemma4TextConfig,
        transformers.Gemma4ForCausalLM,
        dict(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            global_head_dim=32,
            sliding_window=6,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            hidden_size_per_layer_input=0,
            tie_word_embeddings=False,
            rope_parameters=GEMMA4_ROPE,
        ),
    ),
}


def make_reference(family: str, directory: Path) -> transformers.PreTrainedModel:
    """A seeded transformers model with every parameter (and Gemma 4's layer_scalar) moved off its
    near-degenerate init, saved to `directory`."""
    config_cls, model_cls, kwargs = CONFIGS[family]
    torch.manual_seed(4321)
    config = config_cls(**kwargs, attn_implementation="eager")
    config._experts_implementation = "eager"  # the grouped-mm experts do not run in float64
    model = model_cls(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(torch.randn_like(p) * (0.1 if "norm" in name or "scale" in name else 0.0))
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(0.5 + torch.rand_like(b))
    model.save_pretrained(directory)
    return model


# ---- GGUF as llama.cpp's convert_hf_to_gguf.py writes these architectures ----------------------

ATTENTION = {"attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
             "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
             "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
             "attn_norm.weight": "input_layernorm.weight"}  # fmt: skip
DENSE = {"ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
         "ffn_down.weight": "mlp.down_proj.weight"}  # fmt: skip
QWEN3 = ATTENTION | DENSE | {"ffn_norm.weight": "post_attention_layernorm.weight", "ffn_gate_inp.weight": "mlp.gate.weight",
                             "ffn_down_exps.weight": "mlp.experts.down_proj"}  # fmt: skip
BIASES = {"attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
          "attn_v.bias": "self_attn.v_proj.bias"}  # fmt: skip
GEMMA4 = ATTENTION | DENSE | {
    "post_attention_norm.weight": "post_attention_layernorm.weight", "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight", "pre_ffw_norm_2.weight": "pre_feedforward_layernorm_2.weight",
    "post_ffw_norm_1.weight": "post_feedforward_layernorm_1.weight", "post_ffw_norm_2.weight": "post_feedforward_layernorm_2.weight",
    "ffn_gate_inp.weight": "router.proj.weight", "ffn_gate_inp.scale": "router.scale",
    "ffn_down_exps.scale": "router.per_expert_scale", "ffn_gate_up_exps.weight": "experts.gate_up_proj",
    "ffn_down_exps.weight": "experts.down_proj", "layer_output_scale.weight": "layer_scalar",
}  # fmt: skip
TOKENS = [f"t{i}" for i in range(VOCAB)]


def gguf_tensors(family: str, cfg: Any, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    tensors = {"token_embd.weight": sd["model.embed_tokens.weight"], "output_norm.weight": sd["model.norm.weight"]}
    if not cfg.tie_word_embeddings:
        tensors["output.weight"] = sd["lm_head.weight"]
    names = GEMMA4 if family.startswith("gemma4") else QWEN3 | BIASES
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        tensors |= {f"blk.{i}.{g}": sd[p + h] for g, h in names.items() if p + h in sd}
        if family == "qwen3_moe" and p + "mlp.experts.gate_up_proj" in sd:  # separate gate / up stacks [E, I, H]
            gate, up = sd[p + "mlp.experts.gate_up_proj"].chunk(2, dim=1)
            tensors |= {f"blk.{i}.ffn_gate_exps.weight": gate, f"blk.{i}.ffn_up_exps.weight": up}
    if family.startswith("gemma4"):  # the proportional rope's frequency factors (full layers), as the converter adds
        pairs = cfg.per_layer_config[cfg.layer_types.index("full_attention")].head_dim // 2
        turned = int(pairs * 0.25 * 2 // 2)
        tensors["rope_freqs.weight"] = torch.tensor([1.0] * turned + [1e30] * (pairs - turned))
    return tensors


def gguf_metadata(family: str, cfg: Any) -> dict[str, object]:
    kv: dict[str, object] = {
        "block_count": cfg.num_hidden_layers, "context_length": cfg.max_position_embeddings,
        "embedding_length": cfg.hidden_size, "feed_forward_length": cfg.intermediate_size,
        "attention.head_count": cfg.num_attention_heads, "attention.layer_norm_rms_epsilon": cfg.rms_norm_eps,
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": TOKENS,
        "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
    }  # fmt: skip
    if family.startswith("qwen3"):
        kv |= {"attention.head_count_kv": cfg.num_key_value_heads, "attention.key_length": cfg.head_dim,
               "attention.value_length": cfg.head_dim, "rope.freq_base": 5000.0}  # fmt: skip
    if family.startswith(("qwen2", "mistral")):
        kv |= {"attention.head_count_kv": cfg.num_key_value_heads, "rope.freq_base": 5000.0}
    if family == "qwen3_moe":
        kv |= {"expert_count": cfg.num_experts, "expert_used_count": cfg.num_experts_per_tok,
               "expert_feed_forward_length": cfg.moe_intermediate_size}  # fmt: skip
    if family.startswith("gemma4"):
        sliding = [t == "sliding_attention" for t in cfg.layer_types]
        layer = cfg.per_layer_config  # transformers keeps the head shape per layer
        full, swa = layer[sliding.index(False)], layer[sliding.index(True)]
        kv |= {
            "attention.head_count_kv": [layer[i].num_key_value_heads for i in range(len(sliding))],
            "attention.sliding_window_pattern": sliding, "attention.sliding_window": cfg.sliding_window,
            "attention.key_length": full.head_dim, "attention.value_length": full.head_dim,
            "attention.key_length_swa": swa.head_dim, "attention.value_length_swa": swa.head_dim,
            "rope.freq_base": 10_000.0, "rope.freq_base_swa": 100.0, "rope.dimension_count": full.head_dim,
            "rope.dimension_count_swa": swa.head_dim, "attention.shared_kv_layers": 0,
            "embedding_length_per_layer_input": 0,
        }  # fmt: skip
        if cfg.final_logit_softcapping:
            kv["final_logit_softcapping"] = cfg.final_logit_softcapping
        if cfg.enable_moe_block:
            kv |= {"expert_count": cfg.num_experts, "expert_used_count": cfg.top_k_experts,
                   "expert_feed_forward_length": cfg.moe_intermediate_size}  # fmt: skip
    return kv


# Mistral: llama.cpp writes it as `llama` with permuted q/k rows, which this writer does not do;
# its GGUF tests are skipped (the Llama path is tested in test_model_parity.py).
ARCH = {
    "qwen3": "qwen3",
    "qwen3_swa": "qwen3",
    "qwen3_moe": "qwen3moe",
    "gemma4": "gemma4",
    "gemma4_dense": "gemma4",
    "qwen2": "qwen2",
    "qwen2_swa": "qwen2",
    "mistral": "llama",
}
NO_GGUF = {
    "mistral": "llama.cpp writes Mistral as `llama` (permuted q/k rows); the Llama GGUF path is tested elsewhere"
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    directory = Path(tmp_path_factory.mktemp(request.param))
    reference = make_reference(request.param, directory / "hf")
    sd = {k: v.detach().clone() for k, v in reference.state_dict().items()}
    cfg = reference.config
    path = write_gguf(
        directory / "model.gguf",
        ARCH[request.param],
        gguf_metadata(request.param, cfg),
        {k: np32(v) for k, v in gguf_tensors(request.param, cfg, sd).items()},
    )
    ids = random.Random(11).choices(range(VOCAB), k=L)
    return {
        "name": request.param,
        "dir": directory / "hf",
        "gguf": path,
        "sd": sd,
        "cfg": cfg,
        "ids": ids,
        "ref": {dt: reference_logits(reference, ids, dt) for dt in (*TOL, torch.bfloat16)},
        "models": {},
    }


def model_of(family: dict[str, Any], dtype: torch.dtype) -> Any:
    if dtype not in family["models"]:
        family["models"][dtype] = load_freetoken(family["dir"], dtype)
    return family["models"][dtype]


def assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, family: dict[str, Any]) -> None:
    assert got.dtype == want.dtype
    # transformers' Gemma4RMSNorm computes in float32 even in a float64 model: its float64
    # reference is only float32-exact
    tol = TOL[torch.float32] / 10 if dtype == torch.float64 and family["name"].startswith("gemma4") else TOL[dtype]
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


@pytest.mark.parametrize(
    ("dtype", "page_size"),
    [(torch.float32, 4), (torch.float64, 1), (torch.float64, 4)],
    ids=["f32-4", "f64-1", "f64-4"],
)
def test_prefill_all_logits(family: dict[str, Any], dtype: torch.dtype, page_size: int) -> None:
    runner = PagedRunner(model_of(family, dtype), page_size, dtype)
    (logits,) = runner.step([(Seq(), family["ids"])], all_logits=True)
    assert logits.shape == (L, VOCAB)
    assert_close(logits, family["ref"][dtype], dtype, family)


def test_decode_with_released_swa_pages(family: dict[str, Any]) -> None:
    """A short prefill, then one token per step (pages of 1) with out-of-window SWA pages
    released, poisoned with NaN and reused: every row still matches the reference."""
    dtype = torch.float64
    runner = PagedRunner(model_of(family, dtype), 1, dtype, pages=40)
    seq, ids = Seq(), family["ids"]
    rows = runner.step([(seq, ids[:3])])
    for t in range(3, L):
        rows.extend(runner.step([(seq, [ids[t]])]))
        runner.release_out_of_window(seq, poison=True)
    if runner.config.has_swa:
        assert 0 in seq.swa  # pages really were released
    assert_close(torch.cat(rows), family["ref"][dtype][2:], dtype, family)
    assert runner.kv.null_pages_are_zero()


def test_mixed_batch_equals_running_alone(family: dict[str, Any]) -> None:
    dtype = torch.float64
    model, ids = model_of(family, dtype), family["ids"]
    other = list(reversed(ids))

    def run(together: bool) -> tuple[torch.Tensor, torch.Tensor]:
        runner = PagedRunner(model, 4, dtype)
        a, b = Seq(), Seq()
        runner.step([(a, ids[:6])])
        runner.step([(b, other[:9])])
        if together:
            la, lb = runner.step([(a, ids[6:15]), (b, other[9:10])], all_logits=True)
        else:
            (la,) = runner.step([(a, ids[6:15])], all_logits=True)
            (lb,) = runner.step([(b, other[9:10])], all_logits=True)
        return la, lb

    (la, lb), (ra, rb) = run(True), run(False)
    torch.testing.assert_close(la, ra, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(lb, rb, atol=1e-12, rtol=1e-12)
    assert_close(la, family["ref"][dtype][6:15], dtype, family)


def test_bfloat16_runs_close_to_float32(family: dict[str, Any]) -> None:
    """bfloat16 weights and K/V: no farther from float32 than transformers' own bfloat16 run
    (Gemma 4's scale-1 attention over normed q/k amplifies rounding: about 25% of the largest
    logit there, under 1% for Qwen3)."""
    dtype = torch.bfloat16
    runner = PagedRunner(load_freetoken(family["dir"], dtype), 4, dtype)
    seq, ids = Seq(), family["ids"]
    rows = runner.step([(seq, ids[:10])])
    for t in range(10, L):
        rows.extend(runner.step([(seq, [ids[t]])]))
    got, want = torch.cat(rows), family["ref"][torch.float32][9:]
    err = (got - want).abs().max().item()
    theirs = (family["ref"][torch.bfloat16][9:].float() - want).abs().max().item()
    assert err < 1.25 * theirs + 0.01 * want.abs().max().item(), (err, theirs)


def test_gguf_gives_the_hf_state_dict_and_config(family: dict[str, Any]) -> None:
    if family["name"] in NO_GGUF:
        pytest.skip(NO_GGUF[family["name"]])
    ck = load_gguf(family["gguf"])
    cfg, sd = family["cfg"], family["sd"]
    expected = {k for k in sd if not (cfg.tie_word_embeddings and k == "lm_head.weight")}
    if family["name"].startswith("gemma4") and cfg.attention_k_eq_v:
        assert not any(k.endswith("v_proj.weight") and ".2." in k for k in expected)  # k_eq_v: no v_proj in full layers
    assert set(ck.tensors) == expected
    for name in expected:
        assert torch.equal(ck.tensors[name], sd[name]), name
    built = type(cfg)(**{k: v for k, v in ck.hf_config.items() if k != "model_type"})
    keys = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "tie_word_embeddings"]  # fmt: skip
    if family["name"].startswith("qwen3"):
        keys += ["num_key_value_heads", "head_dim"]
    if family["name"].startswith("qwen2"):
        keys += ["num_key_value_heads"]
    if family["name"] == "qwen3_moe":
        keys += ["num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "mlp_only_layers"]
    if family["name"].startswith("gemma4"):
        keys += ["layer_types", "sliding_window", "rope_parameters", "attention_k_eq_v", "enable_moe_block",
                 "num_experts", "top_k_experts", "moe_intermediate_size", "final_logit_softcapping"]  # fmt: skip
        for i in range(cfg.num_hidden_layers):  # head_dim and kv heads, per layer
            got, want = built.per_layer_config[i], cfg.per_layer_config[i]
            assert (got.head_dim, got.num_key_value_heads) == (want.head_dim, want.num_key_value_heads), i
    for key in keys:
        assert getattr(built, key) == getattr(cfg, key), key


@pytest.mark.parametrize("family", ["qwen3_moe"], indirect=True)  # a family whose model holds its router in float32
def test_a_gguf_router_reaches_the_model_unrounded(family: dict[str, Any]) -> None:
    """The routers a model holds in float32 get the file's float32 values under a bfloat16 load,
    not the values rounded to bfloat16 on the way (the family's `float32` names)."""
    ck = load_gguf(family["gguf"], dtype=torch.bfloat16)
    routers = [k for k in ck.tensors if k.endswith("mlp.gate.weight")]
    assert routers
    for name in routers:
        assert ck.tensors[name].dtype == torch.float32 and torch.equal(ck.tensors[name], family["sd"][name]), name
    assert ck.tensors["model.layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16  # the rest is rounded
    model = build_model(config_from_hf(ck.hf_config), torch.bfloat16, "cpu")
    model.load_weights(ck.tensors)
    gate = dict(model.named_parameters())[routers[0].removeprefix("model.")]
    assert gate.dtype == torch.float32 and torch.equal(gate, family["sd"][routers[0]])


def test_gguf_model_matches_transformers(family: dict[str, Any]) -> None:
    """The model built from the GGUF file's config and tensors gives the reference logits."""
    if family["name"] in ("qwen3_swa", "qwen2_swa"):
        pytest.skip("llama.cpp's qwen3 / qwen2 have no sliding-window layers, so their GGUF keys carry none")
    if family["name"] in NO_GGUF:
        pytest.skip(NO_GGUF[family["name"]])
    dtype = torch.float64
    ck = load_gguf(family["gguf"], dtype=dtype)
    model = build_model(config_from_hf(ck.hf_config), dtype, "cpu")
    model.load_weights(ck.tensors)
    (logits,) = PagedRunner(model, 4, dtype).step([(Seq(), family["ids"])], all_logits=True)
    assert_close(logits, family["ref"][dtype], dtype, family)


def test_kv_pools_take_each_layer_kinds_head_shape(family: dict[str, Any]) -> None:
    """Gemma 4's full layers store [n_kv 1, 32] heads, its sliding ones [2, 16]; the others one shape."""
    runner = PagedRunner(model_of(family, torch.float64), 4, torch.float64)
    c = runner.config
    shapes = {tuple(runner.kv.k[i].shape[2:]) for i in range(c.num_layers)}
    if family["name"].startswith("gemma4"):
        full_heads = 1 if family["name"] == "gemma4" else 2
        assert {tuple(runner.kv.k[i].shape[2:]) for i in c.full_layers} == {(full_heads, 32)}
        assert {tuple(runner.kv.k[i].shape[2:]) for i in c.swa_layers} == {(2, 16)}
    else:
        assert shapes == {(c.num_kv_heads, c.head_dim)}


def test_int8_weights_stay_close_and_quantize_the_experts(family: dict[str, Any]) -> None:
    """`--weights int8`: attention, MLP and expert matrices run as 8-bit groups (routers and norms
    stay float). The logits stay within 3% (relative norm) of a float twin holding the same
    weights rounded to the int8 grid (only the kernel's int8 activations differ), and for Qwen3
    within 5% of the float model. Gemma 4's scale-1 attention over normed q/k turns these tiny
    random weights chaotic (transformers' own bfloat16 run is 8-23% off): its twin bound is 15%
    and the grid itself is not bounded there."""
    import json

    from freetoken.models.experts import Experts
    from freetoken.ops.quantized import dequantize, quantize_int8
    from freetoken.weights.safetensors import load_safetensors_dir

    directory = family["dir"]
    config = config_from_hf(json.loads((directory / "config.json").read_text()))
    tensors = load_safetensors_dir(directory, dtype=torch.float32)

    def gridded(name: str, w: torch.Tensor) -> torch.Tensor:
        quantized = (
            w.dim() >= 2 and "norm" not in name and "router" not in name and not name.endswith("mlp.gate.weight")
        )
        if not quantized:
            return w
        return torch.stack([dequantize(quantize_int8(m)) for m in w]) if w.dim() == 3 else dequantize(quantize_int8(w))

    def last_logits(weights: str, source: dict[str, Any]) -> tuple[torch.Tensor, Any]:
        model = build_model(config, torch.float32, "cpu")
        model.load_weights(dict(source), weights)
        seq, ids = Seq(), family["ids"]
        runner = PagedRunner(model, 4, torch.float32)
        runner.step([(seq, ids[:12])])
        return runner.step([(seq, ids[12:])])[0][-1].double(), model

    got, model = last_logits("int8", tensors)
    experts = [m for m in model.modules() if isinstance(m, Experts)]
    assert all(e.runs_as().startswith("int8") for e in experts)
    assert bool(experts) == (family["name"] in ("qwen3_moe", "gemma4"))
    twin, _ = last_logits("auto", {n: gridded(n, w) for n, w in tensors.items()})
    kernel_tolerance = 0.15 if family["name"].startswith("gemma4") else 0.03  # Gemma 4 measured 0.07-0.10
    assert float((got - twin).norm() / twin.norm()) < kernel_tolerance
    if family["name"].startswith("qwen3"):
        want = family["ref"][torch.float32][-1].double()
        assert float((got - want).norm() / want.norm()) < 0.05


def test_tensor_parallel_is_refused_where_no_shard_plan_exists() -> None:
    from freetoken.errors import ConfigError
    from freetoken.models.shard import check_shardable

    config_cls, _, kwargs = CONFIGS["gemma4"]
    config = config_from_hf(config_cls(**kwargs).to_dict())
    check_shardable(config, 1)
    with pytest.raises(ConfigError, match="--tensor-parallel-size 2 is not supported"):
        check_shardable(config, 2)


def test_qwen3_moe_splits_whole_experts_or_is_refused() -> None:
    """Qwen3-MoE is expert-parallel (models/shard.py): ranks that divide its experts are taken, others refused."""
    from freetoken.errors import ConfigError
    from freetoken.models.shard import ShardPlan, check_shardable

    config_cls, _, kwargs = CONFIGS["qwen3_moe"]
    config = config_from_hf(config_cls(**kwargs).to_dict())
    check_shardable(config, 2)
    assert [ShardPlan(r, 2, config).experts for r in (0, 1)] == [range(0, 2), range(2, 4)]
    with pytest.raises(ConfigError, match=f"does not divide the model's {config.num_experts} experts"):
        check_shardable(config, 3)


def test_gemma4_26b_a4b_shaped_config_and_kv_layout() -> None:
    """The multimodal config.json form (`gemma4` + `text_config`) with 26B-A4B's attention shape:
    25 sliding layers (window 1024, 8 kv heads of 256) and 5 full ones (2 kv heads of 512, keys as
    values): each pool is sized by its own heads (the full pool 20,480 bytes per token in bf16)."""
    from freetoken.kv.tensors import KVTensors

    text = dict(
        hidden_size=2816,
        num_hidden_layers=30,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=256,
        global_head_dim=512,
        num_global_key_value_heads=2,
        attention_k_eq_v=True,
        sliding_window=1024,
        hidden_size_per_layer_input=0,
        enable_moe_block=True,
        num_experts=128,
        top_k_experts=8,
        moe_intermediate_size=704,
        intermediate_size=2112,
        vocab_size=262_144,
    )
    config = config_from_hf({"model_type": "gemma4", "text_config": text, "vision_config": {}})
    assert (
        config.architecture == "gemma4" and len(config.swa_layers) == 25 and config.full_layers == (5, 11, 17, 23, 29)
    )
    layout = config.kv_layout()
    assert layout.head_shape(True) == (8, 256) and layout.head_shape(False) == (2, 512)
    assert KVTensors.bytes_per_page(layout, 1, torch.bfloat16, sliding=False) == 5 * 2 * 2 * 512 * 2
    assert KVTensors.bytes_per_page(layout, 1, torch.bfloat16, sliding=True) == 25 * 2 * 8 * 256 * 2
    assert config.attention_scale == 1.0 and config.for_layer(5).head_dim == 512 and config.for_layer(0).head_dim == 256


@pytest.mark.parametrize(
    ("key", "value"),
    [("hidden_size_per_layer_input", 256), ("num_kv_shared_layers", 4), ("use_bidirectional_attention", "all")],
)
def test_gemma4_features_not_modelled_are_refused(key: str, value: object) -> None:
    from freetoken.errors import ModelLoadError

    base = dict(num_hidden_layers=6, hidden_size_per_layer_input=0, model_type="gemma4_text")
    with pytest.raises(ModelLoadError, match="not supported"):
        config_from_hf({**base, key: value})


def test_gemma4_multimodal_checkpoint_names_load(family: dict[str, Any]) -> None:
    """`model.language_model.` names (Gemma4ForConditionalGeneration's) with tower tensors beside
    them load into the same model."""
    if family["name"] != "gemma4":
        pytest.skip("one Gemma 4 checkpoint is enough")
    from freetoken.weights.safetensors import load_safetensors_dir

    tensors = load_safetensors_dir(family["dir"], dtype=torch.float64)
    renamed = {name.replace("model.", "model.language_model.", 1): t for name, t in tensors.items()}
    renamed["model.vision_tower.encoder.layers.0.mlp.up_proj.weight"] = torch.zeros(2, 2)
    model = build_model(config_from_hf(family["cfg"].to_dict()), torch.float64, "cpu")
    model.load_weights(renamed)
    (logits,) = PagedRunner(model, 4, torch.float64).step([(Seq(), family["ids"])], all_logits=True)
    assert_close(logits, family["ref"][torch.float64], torch.float64, family)
