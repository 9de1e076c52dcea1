"""GLM-4.5 MoE (`glm4_moe`) against transformers on tiny random weights (`tiny_models.py`).

Two shapes: GLM-4.5's (q/k norms, experts in 2 groups of 4 with one group kept per token) and
GLM-4.5-Air's (no q/k norms, one group); both with a dense first layer, q/k/v biases, half of each
head rotated, a random router correction bias and a routed scale of 2.5. Logits of a whole-prompt
prefill (float64 and float32), of prefill chunks then decode rows batched with another request;
the router alone against transformers' on many tokens (where the bias and the group limit change
the choice); a checkpoint's multi-token-prediction layer ignored. Tolerances: 1e-6 in float64
(transformers scores the router in float32 whatever the model dtype), 1e-4 in float32.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from freetoken.models.glm4_moe import GroupRouter
from freetoken.models.registry import config_from_hf

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from model_harness import PagedRunner, Seq, load_freetoken  # noqa: E402
from tiny_models import GLM4_MOE, VOCAB, write_tiny_model  # noqa: E402

L = 23
TOL = {torch.float64: 1e-6, torch.float32: 1e-4}
SHAPES = {"glm4_5": {}, "glm4_5_air": {"use_qk_norm": False, "n_group": 1, "topk_group": 1}}


@pytest.fixture(scope="module", params=list(SHAPES))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    directory = write_tiny_model("glm4_moe", Path(tmp_path_factory.mktemp(request.param)), **SHAPES[request.param])
    ref = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float64, attn_implementation="eager")
    ref.config._experts_implementation = "eager"
    ids = random.Random(5).choices(range(VOCAB), k=L)
    with torch.no_grad():
        logits = ref(torch.tensor([ids])).logits[0]
    return {"dir": directory, "ids": ids, "ref": logits}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_prefill_logits(family: dict[str, Any], dtype: torch.dtype) -> None:
    (got,) = PagedRunner(load_freetoken(family["dir"], dtype), 4, dtype).step(
        [(Seq(), family["ids"])], all_logits=True
    )
    torch.testing.assert_close(got.double(), family["ref"], atol=TOL[dtype], rtol=TOL[dtype])


def test_chunks_then_decode_rows_beside_another_request(family: dict[str, Any]) -> None:
    """Chunks of 6 and 5 tokens, then one token per step; a second request (the prompt reversed)
    prefills and decodes in the same batches, its tokens routed with the first's."""
    runner = PagedRunner(load_freetoken(family["dir"], torch.float64), 4, torch.float64)
    ids, other = family["ids"], list(reversed(family["ids"]))
    a, b = Seq(), Seq()
    rows = runner.step([(a, ids[:6])], all_logits=True)
    got_a, _ = runner.step([(a, ids[6:11]), (b, other[:9])], all_logits=True)
    rows.append(got_a)
    for t in range(11, L):
        got_a, _ = runner.step([(a, [ids[t]]), (b, [other[t - 2]])], all_logits=True)
        rows.append(got_a)
    torch.testing.assert_close(torch.cat(rows), family["ref"], atol=1e-6, rtol=1e-6)


def test_config_reads_the_family(family: dict[str, Any]) -> None:
    hf = json.loads((family["dir"] / "config.json").read_text())
    c = config_from_hf(hf)
    assert c.architecture == "glm4_moe" and c.dense_mlp_layers == (0,)
    assert c.rope_full.partial_rotary_factor == 0.5 and c.attention_bias and c.o_proj_bias is False
    assert (c.num_experts, c.num_experts_per_tok, c.shared_expert_intermediate_size) == (8, 2, 32)
    assert (c.n_group, c.topk_group, c.routed_scaling_factor, c.qk_norm) == (
        hf["n_group"], hf["topk_group"], 2.5, hf["use_qk_norm"],
    )  # fmt: skip


def test_router_chooses_and_weighs_as_transformers() -> None:
    """16 experts in 4 groups, 2 groups kept, 4 experts per token, over 300 tokens: the same
    experts with the same weights. The inputs are such that both the correction bias and the group
    limit change some token's choice (else the test could not tell them missing)."""
    hf = transformers.Glm4MoeConfig(
        **{**GLM4_MOE, "n_routed_experts": 16, "n_group": 4, "topk_group": 2, "num_experts_per_tok": 4}
    )
    torch.manual_seed(0)
    ref = transformers.models.glm4_moe.modeling_glm4_moe.Glm4MoeTopkRouter(hf)
    with torch.no_grad():
        ref.weight.normal_(0, 0.2)
        ref.e_score_correction_bias.normal_(0, 0.1)
    router = GroupRouter(config_from_hf(hf.to_dict()), torch.float32, "cpu")
    router.load_state_dict({"weight": ref.weight, "e_score_correction_bias": ref.e_score_correction_bias})
    x = torch.randn(300, hf.hidden_size)
    with torch.no_grad():
        _, want_w, want_ids = ref(x)
        ids, weights = router(x)
    order, want_order = ids.argsort(dim=-1), want_ids.argsort(dim=-1)
    assert torch.equal(ids.gather(1, order), want_ids.gather(1, want_order))
    torch.testing.assert_close(weights.gather(1, order), want_w.gather(1, want_order), atol=1e-6, rtol=1e-6)
    # the bias and the group limit each matter for these inputs
    scores = torch.sigmoid(x @ ref.weight.T)
    unbiased = scores.topk(4, dim=-1).indices.sort(dim=-1).values
    ungrouped = (scores + ref.e_score_correction_bias).topk(4, dim=-1).indices.sort(dim=-1).values
    chosen = want_ids.sort(dim=-1).values
    assert (unbiased != chosen).any(dim=-1).sum() > 10
    assert (ungrouped != chosen).any(dim=-1).sum() > 10
    assert abs(float(weights.sum(dim=-1).mean()) - 2.5) < 1e-5  # renormalised, then scaled


def test_a_multi_token_prediction_layer_is_ignored(family: dict[str, Any], tmp_path: Path) -> None:
    """GLM-4.5's checkpoints hold an MTP layer after the decoder layers (`model.layers.{N}.*`,
    `num_nextn_predict_layers`): the model loads without it and gives the same logits."""
    directory = tmp_path / "mtp"
    directory.mkdir()
    for f in family["dir"].iterdir():
        (directory / f.name).write_bytes(f.read_bytes())
    add_mtp_layer(directory)
    (got,) = PagedRunner(load_freetoken(directory, torch.float64), 4, torch.float64).step(
        [(Seq(), family["ids"])], all_logits=True
    )
    torch.testing.assert_close(got, family["ref"], atol=1e-6, rtol=1e-6)


def add_mtp_layer(directory: Path) -> None:
    """Give a saved tiny checkpoint an MTP layer as GLM-4.5's hold: the last decoder layer's
    tensors again under the next index, plus `eh_proj`, `enorm`, `hnorm`, `embed_tokens` and
    `shared_head` (random values); `num_nextn_predict_layers` 1."""
    config = json.loads((directory / "config.json").read_text())
    n, hidden = config["num_hidden_layers"], config["hidden_size"]
    sd = load_file(directory / "model.safetensors")
    last = f"model.layers.{n - 1}."
    mtp = f"model.layers.{n}."
    extra = {mtp + k[len(last) :]: v.clone() + 0.01 for k, v in sd.items() if k.startswith(last)}
    extra |= {
        mtp + "eh_proj.weight": torch.randn(hidden, 2 * hidden) * 0.02,
        mtp + "enorm.weight": torch.ones(hidden),
        mtp + "hnorm.weight": torch.ones(hidden),
        mtp + "embed_tokens.weight": torch.randn(config["vocab_size"], hidden) * 0.02,
        mtp + "shared_head.head.weight": torch.randn(config["vocab_size"], hidden) * 0.02,
        mtp + "shared_head.norm.weight": torch.ones(hidden),
    }
    save_file({**sd, **extra}, directory / "model.safetensors", metadata={"format": "pt"})
    config["num_nextn_predict_layers"] = 1
    (directory / "config.json").write_text(json.dumps(config))


def test_the_family_chooses_the_glm45_tool_parser(family: dict[str, Any]) -> None:
    """A GLM checkpoint whose template and vocabulary carry no marker still gets GLM's tool-call
    format, by its architecture (the name the server reports is `ModelConfig.architecture`)."""
    from freetoken.tokenizer.tool_parsers.registry import detect_tool_parser

    arch = config_from_hf(json.loads((family["dir"] / "config.json").read_text())).architecture
    assert detect_tool_parser(chat_template=None, special_tokens=[], architecture=arch) == "glm45"


def test_bfloat16_runs_close_to_float32(family: dict[str, Any]) -> None:
    """bfloat16 weights and K/V (router and correction bias held in float32): a prefill chunk then
    decode rows no farther from the float64 reference than transformers' own bfloat16 run, plus 1% of
    the largest logit."""
    want_model = transformers.AutoModelForCausalLM.from_pretrained(
        family["dir"], dtype=torch.bfloat16, attn_implementation="eager"
    )
    want_model.config._experts_implementation = "eager"
    ids = family["ids"]
    with torch.no_grad():
        theirs = want_model(torch.tensor([ids])).logits[0].double()
    model = load_freetoken(family["dir"], torch.bfloat16)
    assert model.layers[1].mlp.gate.e_score_correction_bias.dtype == torch.float32
    runner, seq = PagedRunner(model, 4, torch.bfloat16), Seq()
    rows = runner.step([(seq, ids[:10])], all_logits=True)
    for t in range(10, L):
        rows.extend(runner.step([(seq, [ids[t]])]))
    want = family["ref"].double()
    err = (torch.cat(rows).double() - want).abs().max().item()
    bound = 1.25 * (theirs - want).abs().max().item() + 0.01 * want.abs().max().item()
    assert err < bound, (err, bound)
