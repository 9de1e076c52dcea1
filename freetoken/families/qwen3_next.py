"""Qwen3-Next (Qwen3-Next-80B-A3B; `qwen3_next`): what the layers below the models know of it
(the model is `models/qwen3_5.py`).

The same network as Qwen3.5-MoE's text model (Gated DeltaNet layers, gated full attention over a
quarter of each head, routed experts beside a gated shared expert, `(1 + w)` norms), with two
differences the model's reader and loader handle: the linear layers' input projections are stored
fused, `in_proj_qkvz` and `in_proj_ba`, their rows grouped by key head (split at load into
Qwen3.5's `in_proj_qkv` / `in_proj_z` / `in_proj_b` / `in_proj_a`), and the config names dense
layers (`mlp_only_layers`, `decoder_sparse_step`) and whether the top k are renormalised
(`norm_topk_prob`).

GGUF (`qwen3next`): Qwen3.5-MoE's tensors and keys, but llama.cpp's converter keeps HF's grouped
order of the value heads (no tiling to undo), writes q/k/v (`attn_qkv`) and z (`attn_gate`) apart
and b/a fused (`ssm_ba`, split by the model like HF's `in_proj_ba`); an older converter's fused
`ssm_in` is HF's `in_proj_qkvz` as it is. llama.cpp always renormalises the top k and has no dense
layers in this architecture.
"""

from __future__ import annotations

from collections.abc import Collection

from freetoken.families import qwen3_5, qwen3_5_moe
from freetoken.families.base import A_LOG, CONV_KERNEL, ONE_ROW, ROWS, Family, GGUFFacts, HFFacts
from freetoken.families.gguf_keys import Keys

TENSORS: dict[str, str] = {
    **{k: v for k, v in qwen3_5_moe.TENSORS.items() if k not in ("ssm_alpha.weight", "ssm_beta.weight")},
    "ssm_ba.weight": "linear_attn.in_proj_ba.weight",
    "ssm_in.weight": "linear_attn.in_proj_qkvz.weight",
}

_LAYOUT = {"ssm_a": A_LOG, "ssm_conv1d.weight": CONV_KERNEL, "ffn_gate_inp_shexp.weight": ONE_ROW}


def layout(rest: str) -> str | None:
    return _LAYOUT.get(rest) or qwen3_5.norm_layout(rest)


def translate(k: Keys, cfg: dict[str, object], tensor_names: Collection[str]) -> None:
    qwen3_5_moe.translate(k, cfg, tensor_names)
    cfg.update(norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])


FAMILY = Family(
    name="qwen3_next",
    model_types=("qwen3_next",),
    hf=HFFacts(default_context=32_768, default_window=None),
    gguf=GGUFFacts(
        arch="qwen3next",
        model_type="qwen3_next",
        hf_class="Qwen3NextForCausalLM",
        translate=translate,
        tensors=TENSORS,
        layout=layout,
        experts_join=ROWS,
        float32=frozenset({"ffn_gate_inp.weight"}),  # the router, held in float32 by the model
        uniform_heads=False,  # the q rows hold the output gate too: checked when the weights are loaded
    ),
    tensor_parallel=None,  # no shard plan: the linear layers' recurrent states, the shared expert
)
