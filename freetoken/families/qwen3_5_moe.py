"""Qwen3.5-MoE (hybrid with experts): what the layers below the models know of it (the model is
`models/qwen3_5.py`).

GGUF (`qwen35moe`): Qwen3.5's layers (`families/qwen3_5.py`) with Qwen3-MoE's routed experts (the
separate gate / up stacks joined on the rows, gate first) plus a shared expert and its gate
(`ffn_gate_inp_shexp`, [1, H]: [H] in a file llama-quantize wrote, which keeps no trailing 1). A
multimodal `config.json` (`qwen3_5_moe`) holds the text model in `text_config`.
"""

from __future__ import annotations

from collections.abc import Collection

from freetoken.families import qwen3_5, qwen3_moe
from freetoken.families.base import ONE_ROW, ROWS, Family, GGUFFacts, HFFacts
from freetoken.families.gguf_keys import Keys

TENSORS: dict[str, str] = {
    **qwen3_5.TENSORS,
    **{
        k: v
        for k, v in qwen3_moe.TENSORS.items()
        if k.startswith(("ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"))
    },
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
}


def layout(rest: str) -> str | None:
    return ONE_ROW if rest == "ffn_gate_inp_shexp.weight" else qwen3_5.layout(rest)


def translate(k: Keys, cfg: dict[str, object], tensor_names: Collection[str]) -> None:
    qwen3_5.translate(k, cfg, tensor_names)
    cfg.update(
        num_experts=k.count("expert_count"),
        num_experts_per_tok=k.count("expert_used_count"),
        moe_intermediate_size=k.count("expert_feed_forward_length"),
        shared_expert_intermediate_size=k.count("expert_shared_feed_forward_length"),
    )


FAMILY = Family(
    name="qwen3_5_moe",
    model_types=("qwen3_5_moe", "qwen3_5_moe_text"),
    hf=HFFacts(default_context=32_768, default_window=None, nested="qwen3_5_moe"),
    gguf=GGUFFacts(
        arch="qwen35moe",
        model_type="qwen3_5_moe_text",
        hf_class="Qwen3_5MoeForCausalLM",
        translate=translate,
        tensors=TENSORS,
        layout=layout,
        experts_join=ROWS,
        float32=frozenset({"ffn_gate_inp.weight"}),  # the router, held in float32 by the model
        uniform_heads=False,
    ),
    tensor_parallel=None,  # no shard plan: the linear layers' recurrent states, the shared expert
)
