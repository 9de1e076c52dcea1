"""Qwen3.5, Qwen3.5-MoE and Qwen3-Next logits against transformers on tiny random weights (`tiny_models.py`),
through a paged runner that also hands each request a state slot: a whole-prompt prefill (the
chunked delta rule), prefill chunks then decode rows (the recurrent form) with another request
in the same batch, and a multimodal checkpoint's nested `text_config` read as the text model.
Tolerance: 1e-6 in float64 (transformers' delta rule runs in float32 whatever the model dtype;
so does ours), 1e-4 in float32."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers

from freetoken.attention.metadata import ForwardBatch
from freetoken.kv.tensors import KVTensors
from freetoken.models.registry import config_from_hf

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from model_harness import load_freetoken  # noqa: E402
from tiny_models import VOCAB, write_tiny_model  # noqa: E402

L = 23
TOL = {torch.float64: 1e-6, torch.float32: 1e-4}


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_5_moe", "qwen3_next"])
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    directory = write_tiny_model(request.param, Path(tmp_path_factory.mktemp(request.param)))
    ref = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float64, attn_implementation="eager")
    ref.config._experts_implementation = "eager"
    ids = random.Random(5).choices(range(VOCAB), k=L)
    with torch.no_grad():
        logits = ref(torch.tensor([ids])).logits[0]
    return {"dir": directory, "ids": ids, "ref": logits}


class StateRunner:
    """Steps over one KVTensors: each sequence gets its own pages (4 tokens) and state slot."""

    def __init__(self, model: Any, dtype: torch.dtype) -> None:
        self.model = model
        self.kv = KVTensors(model.config.kv_layout(), 64, 0, 4, dtype, "cpu", state_slots=4)
        self.next_page, self.seqs = 1, {}

    def step(self, work: list[tuple[str, list[int]]]) -> list[torch.Tensor]:
        specs, ids, slots = [], [], []
        for name, new in work:
            seq = self.seqs.setdefault(name, {"pages": [], "len": 0, "slot": len(self.seqs) + 1})
            while len(seq["pages"]) * 4 < seq["len"] + len(new):
                seq["pages"].append(self.next_page)
                self.next_page += 1
            specs.append((seq["len"], len(new), np.array(seq["pages"], dtype=np.int32), None))
            slots.append(seq["slot"])
            ids.extend(new)
            seq["len"] += len(new)
        batch = ForwardBatch.build(specs, 4, all_logits=True, state_slots=slots)
        logits = self.model(torch.tensor(ids), batch, self.kv)
        return list(logits.split([len(new) for _, new in work]))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_prefill_logits(family: dict[str, Any], dtype: torch.dtype) -> None:
    (got,) = StateRunner(load_freetoken(family["dir"], dtype), dtype).step([("a", family["ids"])])
    torch.testing.assert_close(got.double(), family["ref"], atol=TOL[dtype], rtol=TOL[dtype])


def test_chunks_then_decode_rows_beside_another_request(family: dict[str, Any]) -> None:
    """Chunks of 6 and 5 tokens, then one token per step; a second request (the prompt reversed)
    prefills and decodes in the same batches from another slot, so each row's state is its own."""
    runner = StateRunner(load_freetoken(family["dir"], torch.float64), torch.float64)
    ids, other = family["ids"], list(reversed(family["ids"]))
    rows = runner.step([("a", ids[:6])])
    a, b = runner.step([("a", ids[6:11]), ("b", other[:9])])
    rows.append(a)
    for t in range(11, L):
        a, b = runner.step([("a", [ids[t]]), ("b", [other[t - 2]])])
        rows.append(a)
    torch.testing.assert_close(torch.cat(rows), family["ref"], atol=1e-6, rtol=1e-6)


def test_multimodal_checkpoint_config_reads_its_text_config(family: dict[str, Any]) -> None:
    """A multimodal checkpoint's `text_config` is the text model's config; Qwen3-Next has none
    (text only): its own config.json is read as it is."""
    text = json.loads((family["dir"] / "config.json").read_text())
    if text["model_type"] == "qwen3_next":
        config = config_from_hf(text)
        assert config.architecture == "qwen3_next" and config.rope_full.partial_rotary_factor == 0.25
        assert config.linear_layers == (0, 1, 2) and config.dense_mlp_layers == (1,)
        return
    moe = text["model_type"] == "qwen3_5_moe_text"
    nested = {"model_type": "qwen3_5_moe" if moe else "qwen3_5", "text_config": text, "vision_config": {}}
    assert config_from_hf(nested) == config_from_hf(text)
    config = config_from_hf(text)
    assert config.has_linear and config.rope_full.partial_rotary_factor == 0.25
    assert config.linear_layers == ((0,) if moe else (0, 1, 2))


def test_qwen3_next_config_reads_its_dense_layers_and_renormalisation() -> None:
    from tiny_models import QWEN3_NEXT

    base = {**QWEN3_NEXT, "model_type": "qwen3_next"}
    config = config_from_hf(base)
    assert config.architecture == "qwen3_next" and config.linear_layers == (0, 1, 2)
    assert config.dense_mlp_layers == (1,) and config.norm_topk_prob and config.num_experts == 4
    assert config_from_hf({**base, "norm_topk_prob": False}).norm_topk_prob is False
    stepped = config_from_hf({**base, "mlp_only_layers": [], "decoder_sparse_step": 2})
    assert stepped.dense_mlp_layers == (0, 2)  # (i + 1) % 2 != 0
    assert config_from_hf({**base, "mlp_only_layers": [], "num_experts": 0}).dense_mlp_layers == (0, 1, 2, 3)


def test_qwen3_next_split_is_transformers_ordering() -> None:
    """The load-time row split of `in_proj_qkvz` / `in_proj_ba` against transformers' own
    `fix_query_key_value_ordering` on random projection outputs."""
    from tiny_models import QWEN3_NEXT
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    from freetoken.models.qwen3_5 import _split_fused_projections

    hf = transformers.Qwen3NextConfig(**QWEN3_NEXT)
    net = Qwen3NextGatedDeltaNet(hf, 0)
    config = config_from_hf({**QWEN3_NEXT, "model_type": "qwen3_next"})
    hidden = torch.randn(1, 5, hf.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        q, k, v, z, b, a = net.fix_query_key_value_ordering(net.in_proj_qkvz(hidden), net.in_proj_ba(hidden))
    rest = {"x.in_proj_qkvz.weight": net.in_proj_qkvz.weight.detach(), "x.in_proj_ba.weight": net.in_proj_ba.weight.detach()}
    _split_fused_projections(rest, "x.", config)
    assert sorted(rest) == ["x.in_proj_a.weight", "x.in_proj_b.weight", "x.in_proj_qkv.weight", "x.in_proj_z.weight"]
    qkv = hidden @ rest["x.in_proj_qkv.weight"].T
    key_dim = config.linear_num_key_heads * config.linear_key_head_dim
    torch.testing.assert_close(qkv[..., :key_dim], q.flatten(2))
    torch.testing.assert_close(qkv[..., key_dim : 2 * key_dim], k.flatten(2))
    torch.testing.assert_close(qkv[..., 2 * key_dim :], v.flatten(2))
    torch.testing.assert_close(hidden @ rest["x.in_proj_z.weight"].T, z.flatten(2))
    torch.testing.assert_close(hidden @ rest["x.in_proj_b.weight"].T, b)
    torch.testing.assert_close(hidden @ rest["x.in_proj_a.weight"].T, a)
