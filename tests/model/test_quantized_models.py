"""Models with quantized weights (`--weights`): the policy, fused loading, and closeness to float.

Tiny random-weight models of each family are loaded float and under `int8` / `int4`. Two checks
with stated tolerances on the relative error of the logits (norm of the difference over the
reference's norm): against a float twin whose weights are the quantized ones dequantized (only
the kernel's int8 activations differ: under 3%), and against the original float model (the grid
itself: int8 under 5%; int4's 16 levels on Gaussian random weights, compounded over the layers of
these 64-wide models, under 40%). The float and `auto` loads of a float checkpoint are identical
(auto keeps a float file float).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from freetoken.errors import ModelLoadError
from freetoken.models.experts import experts_of
from freetoken.models.linear import Linear, QuantizableWeight, apply_policy
from freetoken.models.registry import CausalLM, build_model, config_from_hf
from freetoken.ops.quantized import QuantizedWeight, dequantize, quantize_int4, quantize_int8
from freetoken.ops.qlinear import kernel_available, runs_on_torch
from freetoken.weights.safetensors import load_safetensors_dir
from model_harness import FAMILIES, PagedRunner, Seq, make_reference

IDS = [3, 17, 250, 9, 44, 101, 7, 63, 12, 200, 5]
# Relative error of the last-position logits against the original float model.
TOLERANCE = {"int8": 0.05, "int4": 0.4}
# ... and against the float twin holding the same quantized weights, dequantized.
TWIN_TOLERANCE = 0.03


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    directory = tmp_path_factory.mktemp(request.param)
    make_reference(request.param, directory)
    return request.param, directory


def load(directory: Path, weights: str, dtype: torch.dtype = torch.float32) -> CausalLM:
    config = config_from_hf(json.loads((directory / "config.json").read_text()))
    model = build_model(config, dtype, "cpu")
    model.load_weights(load_safetensors_dir(directory, dtype=dtype), weights)
    return model


def last_logits(model: CausalLM, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    runner = PagedRunner(model, page_size=4, dtype=dtype)
    seq = Seq()
    runner.step([(seq, IDS[:8])])  # a prefill chunk, then two decode steps through the pages
    runner.step([(seq, IDS[8:9])])
    return runner.step([(seq, IDS[9:])])[0][-1].double()


def quantized_modules(model: CausalLM) -> dict[str, int]:
    return {n: m.packed.bits for n, m in model.named_modules() if isinstance(m, QuantizableWeight) and m.packed}


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_quantized_logits_stay_close_to_float(checkpoint: tuple[str, Path], weights: str) -> None:
    family, directory = checkpoint
    ref = last_logits(load(directory, "bf16"))
    model = load(directory, weights)
    bits = quantized_modules(model)
    assert bits and set(bits.values()) == {int(weights[3:])}
    assert any(n.endswith("qkv_proj") for n in bits) and "embed_tokens" in bits
    if family == "gpt_oss":
        assert not any("router" in n for n in bits)  # routers stay float
        assert all(e.runs_as() == f"{weights} (group 32)" for e in experts_of(model))  # experts packed
    else:
        assert any(n.endswith("gate_up_proj") for n in bits)
    got = last_logits(model)
    err = float((got - ref).norm() / ref.norm())
    assert err < TOLERANCE[weights], f"{family} {weights}: relative logits error {err:.4f}"
    twin = load(directory, "bf16")
    twin_modules = dict(twin.named_modules())
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, QuantizableWeight) and module.packed is not None:
                twin_modules[name].weight.copy_(module.packed.dequantize(torch.float32))
        for packed, twin_experts in zip(experts_of(model), experts_of(twin)):
            twin_experts.gate_up = [w.dequantize(torch.float32) for w in packed.gate_up]
            twin_experts.down = [w.dequantize(torch.float32) for w in packed.down]
    twin_ref = last_logits(twin)
    twin_err = float((got - twin_ref).norm() / twin_ref.norm())
    assert twin_err < TWIN_TOLERANCE, f"{family} {weights}: {twin_err:.4f} from its dequantized twin"
    # The kernel's int8 activations make it differ from its twin a little; without the group-32
    # kernel (a CPU without AVX-512) torch multiplies the dequantized weights: exactly the twin.
    assert twin_err > 0 or not kernel_available(), f"{family} {weights}: the kernel did not run"


def test_auto_keeps_a_float_checkpoint_float(checkpoint: tuple[str, Path]) -> None:
    _, directory = checkpoint
    model = load(directory, "auto")
    assert quantized_modules(model) == {}
    assert torch.equal(last_logits(model), last_logits(load(directory, "bf16")))


def test_bf16_activations_run_the_quantized_path(checkpoint: tuple[str, Path]) -> None:
    _, directory = checkpoint
    ref = last_logits(load(directory, "bf16", torch.float32))
    got = last_logits(load(directory, "int8", torch.bfloat16), torch.bfloat16)
    assert float((got - ref).norm() / ref.norm()) < 0.05


def test_policy_on_quantized_and_float_weights() -> None:
    w = torch.randn(8, 64)
    q8, q4 = quantize_int8(w), quantize_int4(w)
    assert apply_policy(q8, "auto") is q8 and apply_policy(q4, "auto") is q4
    widened = apply_policy(q4, "int8")
    assert isinstance(widened, QuantizedWeight) and widened.bits == 8
    assert torch.equal(dequantize(widened), dequantize(q4))  # 4 -> 8 bits is exact
    narrowed = apply_policy(q8, "int4")
    assert isinstance(narrowed, QuantizedWeight) and narrowed.bits == 4
    floats = apply_policy(q8, "bf16")
    assert isinstance(floats, torch.Tensor) and torch.equal(floats, dequantize(q8))
    assert apply_policy(w, "auto") is w and apply_policy(w, "bf16") is w
    odd = torch.randn(8, 40)  # rows that are not whole groups of 32 stay float
    assert apply_policy(odd, "int8") is odd


def test_fused_projection_loads_parts_in_order() -> None:
    """q, k, v rows stacked as q | k | v, whether the parts are float or quantized."""
    from freetoken.models.layers import fuse_projections

    q, k, v = torch.randn(8, 32), torch.randn(4, 32), torch.randn(4, 32)
    fused = fuse_projections(
        {
            "layers.0.attn.q_proj.weight": q,
            "layers.0.attn.k_proj.weight": k,
            "layers.0.attn.v_proj.weight": v,
            "layers.0.norm.weight": torch.ones(32),
        },
        {"layers.0.attn.qkv_proj"},
    )
    assert set(fused) == {"layers.0.attn.qkv_proj.weight", "layers.0.norm.weight"}
    assert torch.equal(fused["layers.0.attn.qkv_proj.weight"], torch.cat([q, k, v]))
    parts = {f"a.{n}_proj.weight": quantize_int8(t) for n, t in (("q", q), ("k", k), ("v", v))}
    stacked = fuse_projections(parts, {"a.qkv_proj"})["a.qkv_proj.weight"]
    assert isinstance(stacked, QuantizedWeight)
    assert torch.equal(dequantize(stacked), torch.cat([dequantize(parts[f"a.{n}_proj.weight"]) for n in "qkv"]))
    incomplete = fuse_projections({"a.q_proj.weight": q}, {"a.qkv_proj"})
    assert set(incomplete) == {"a.q_proj.weight"}  # left for load_named to report


def test_quantized_weight_of_the_wrong_shape_is_a_load_error() -> None:
    layer = Linear(64, 8, False, torch.float32, "cpu")
    with pytest.raises(ModelLoadError, match=r"quantized weight \(8, 32\)"):
        layer.load_quantized(quantize_int8(torch.randn(8, 32)))


def test_prefill_dense_copy_runs_prefill_sized_batches(checkpoint: tuple[str, Path]) -> None:
    """With a dense prefill copy (`--prefill-weights bf16`), batches of PREFILL_ROWS rows or more
    multiply by the dequantized matrix; smaller ones keep the kernel; embeddings keep none."""
    from freetoken.ops.qlinear import PREFILL_ROWS

    family, directory = checkpoint
    config = config_from_hf(json.loads((directory / "config.json").read_text()))
    dense = build_model(config, torch.float32, "cpu")
    dense.load_weights(load_safetensors_dir(directory, dtype=torch.float32), "int8", prefill_weights="bf16")
    plain = load(directory, "int8")
    linears = [m for m in dense.modules() if isinstance(m, Linear) and m.packed is not None]
    assert linears and all(m.dense is not None for m in linears)
    # Without the group-32 kernel (no AVX-512) every torch-fallback weight keeps its copy, the
    # embedding's too, and uses it at every row count (models.linear.keeps_dense_copy).
    fallback = runs_on_torch(linears[0].packed)
    assert (dense.embed_tokens.dense is not None) == fallback
    ids = [(i * 37) % 290 + 3 for i in range(PREFILL_ROWS + 8)]
    got = PagedRunner(dense, 4, torch.float32).step([(Seq(), ids)])[0][-1].double()
    want = PagedRunner(plain, 4, torch.float32).step([(Seq(), ids)])[0][-1].double()
    err = float((got - want).norm() / want.norm())
    assert err < TWIN_TOLERANCE and (err > 0 or fallback), f"{family}: dense prefill {err:.4f} from the kernel's"
    short = ids[: PREFILL_ROWS // 2]  # below the threshold: the kernel, bit for bit the same
    assert torch.equal(
        PagedRunner(dense, 4, torch.float32).step([(Seq(), short)])[0],
        PagedRunner(plain, 4, torch.float32).step([(Seq(), short)])[0],
    )


def test_prefill_weights_auto_keeps_a_copy_only_where_the_kernel_is_slower() -> None:
    """`--prefill-weights auto`: q4_k super-blocks (sbmm keeps up with the bf16 GEMM at prefill
    sizes) and the LM head (it multiplies sampled rows, not the prompt) keep no dense copy; q6_k,
    the group-32 forms and a fused projection with any such part do — in a 16-bit model: a float32
    one keeps none (the copy would be 4 bytes a weight). bf16 copies every quantized layer, quantized
    none, and a float layer never has one."""
    from freetoken.models.linear import HEAD, keeps_dense_copy
    from freetoken.ops.superblock import PackedStack, PackedSuperBlock

    def superblock(kind: str) -> PackedSuperBlock:
        packed = object.__new__(PackedSuperBlock)  # the policy reads the kind only: no kernel needed
        packed.kind = kind
        return packed

    def layer(packed: object, dtype: torch.dtype = torch.bfloat16) -> Linear:
        lin = Linear(32, 8, False, dtype, "cpu")
        lin.packed = packed  # type: ignore[assignment]
        return lin

    q4, q6 = layer(superblock("q4_k")), layer(superblock("q6_k"))
    group32 = layer(object())
    q4_stack = layer(PackedStack.__new__(PackedStack))
    q4_stack.packed.parts = [superblock("q4_k"), superblock("q4_k")]  # type: ignore[union-attr]
    mixed_stack = layer(PackedStack.__new__(PackedStack))
    mixed_stack.packed.parts = [superblock("q4_k"), superblock("q6_k")]  # type: ignore[union-attr]
    auto = {
        name: keeps_dense_copy("auto", lin, "model.layers.0.x.weight")
        for name, lin in [("q4", q4), ("q6", q6), ("group32", group32), ("q4_stack", q4_stack), ("mixed", mixed_stack)]
    }
    assert auto == {"q4": False, "q6": True, "group32": True, "q4_stack": False, "mixed": True}
    assert not keeps_dense_copy("auto", q6, HEAD) and keeps_dense_copy("bf16", q6, HEAD)
    wide = [layer(superblock("q6_k"), torch.float32), layer(object(), torch.float32)]
    assert not any(keeps_dense_copy("auto", lin, "model.layers.0.x.weight") for lin in wide)
    assert all(keeps_dense_copy("bf16", lin, "model.layers.0.x.weight") for lin in wide)
    for lin in (q4, q6, group32, mixed_stack):
        assert keeps_dense_copy("bf16", lin, "w") and not keeps_dense_copy("quantized", lin, "w")
    assert not keeps_dense_copy("bf16", Linear(32, 8, False, torch.float32, "cpu"), "w")  # float: nothing to copy
