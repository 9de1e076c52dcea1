"""Gemma 3: what the layers below the models know of it (the model is `models/gemma3.py`).

GGUF (`gemma3`), with what the files omit filled in as llama.cpp does: every 6th layer is global
(layers 5, 11, 17, ...; llama.cpp's set_swa_pattern(6)), the others slide, unless the file lists
per-layer flags; rope base 10000 on sliding layers and the file's `rope.freq_base` on global ones;
`query_pre_attn_scalar` is head_dim (hidden / heads for the 62-layer 27B model); no soft-capping
unless the file says so. llama.cpp stores every RMSNorm weight as `w + 1` (Gemma's norm
multiplies by `1 + w`); loading subtracts 1 so the tensors mean what HF's Gemma3RMSNorm expects.
A multimodal `config.json` (model_type "gemma3") holds the text model in `text_config`.

For the tokenizer: a GGUF's SentencePiece vocabulary ranks its merges by file position and stores
runs of spaces as spaces (`vocab_by_position`); a model that ships no chat template (the bundled
Gemma 3 270M is a base model) gets `CHAT_TEMPLATE`; tool calls are Gemma's (the `gemma` parser)
where the template and vocabulary show no other format.
"""

from __future__ import annotations

from collections.abc import Collection

from freetoken.errors import ModelLoadError
from freetoken.families.base import (
    ATTENTION,
    DENSE_MLP,
    FULL,
    NORM_MINUS_ONE,
    SLIDING,
    Family,
    GGUFFacts,
    HFFacts,
    layers_of,
)
from freetoken.families.gguf_keys import Keys

SWA_PATTERN = 6  # one global layer per 6; llama.cpp's set_swa_pattern(6)
LOCAL_ROPE_BASE = 10_000.0
LAYERS_27B = 62

TENSORS: dict[str, str] = {
    **ATTENTION,
    **DENSE_MLP,
    "attn_norm.weight": "input_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}


def _layer_types(k: Keys, layers: int) -> list[str]:
    pattern = k.raw("attention.sliding_window_pattern", SWA_PATTERN)
    if isinstance(pattern, list):  # per-layer flags, true = sliding
        if len(pattern) != layers:
            raise ModelLoadError(
                f"{k.arch}.attention.sliding_window_pattern has {len(pattern)} entries for {layers} layers"
            )
        return [SLIDING if flag else FULL for flag in pattern]
    n = k.count("attention.sliding_window_pattern", SWA_PATTERN)
    return [FULL if (i + 1) % n == 0 else SLIDING for i in range(layers)]


def translate(k: Keys, cfg: dict[str, object], tensor_names: Collection[str]) -> None:
    layers = layers_of(cfg)
    head_dim = k.count("attention.key_length", 256)
    hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])  # type: ignore[call-overload]
    full_rope: dict[str, object] = {"rope_type": "default", "rope_theta": k.positive("rope.freq_base", 1_000_000.0)}
    if k.raw("rope.scaling.type", None) == "linear":
        full_rope.update(rope_type="linear", factor=k.positive("rope.scaling.factor"))
    cfg.update(
        intermediate_size=k.count("feed_forward_length"),
        head_dim=head_dim,
        hidden_activation="gelu_pytorch_tanh",
        rope_parameters={SLIDING: {"rope_type": "default", "rope_theta": LOCAL_ROPE_BASE}, FULL: full_rope},
        attention_bias=False,
        query_pre_attn_scalar=hidden // heads if layers == LAYERS_27B else head_dim,
        sliding_window=k.count("attention.sliding_window"),
        layer_types=_layer_types(k, layers),
        final_logit_softcapping=k.optional_positive("final_logit_softcapping"),
        attn_logit_softcapping=k.optional_positive("attn_logit_softcapping"),
        use_bidirectional_attention=False,
    )


def layout(rest: str) -> str | None:
    return NORM_MINUS_ONE if rest.endswith("norm.weight") else None


# Gemma 3's turn format: a system message is folded into the first user turn, the assistant's role
# is called "model", turns must alternate starting with the user, and the text of each turn is
# trimmed. The template writes BOS itself.
CHAT_TEMPLATE = """\
{%- macro turn_text(content) -%}
  {%- if content is string -%}
    {{- content | trim -}}
  {%- elif content is iterable -%}
    {%- for part in content -%}
      {%- if part['type'] == 'text' -%}{{- part['text'] | trim -}}
      {%- elif part['type'] == 'image' -%}{{- '<start_of_image>' -}}
      {%- endif -%}
    {%- endfor -%}
  {%- else -%}
    {{- raise_exception('message content must be a string or a list of parts') -}}
  {%- endif -%}
{%- endmacro -%}
{{- bos_token -}}
{%- set state = namespace(head='', turns=messages) -%}
{%- if messages and messages[0]['role'] == 'system' -%}
  {%- set system = messages[0]['content'] -%}
  {%- if system is not string -%}{%- set system = system[0]['text'] -%}{%- endif -%}
  {%- set state.head = system + '\\n\\n' -%}
  {%- set state.turns = messages[1:] -%}
{%- endif -%}
{%- for message in state.turns -%}
  {%- set expected = 'user' if loop.index0 % 2 == 0 else 'assistant' -%}
  {%- if message['role'] != expected -%}
    {{- raise_exception('Gemma 3 conversations must alternate user/assistant/user/... after an optional system message') -}}
  {%- endif -%}
  {{- '<start_of_turn>' + ('model' if message['role'] == 'assistant' else 'user') + '\\n' -}}
  {%- if loop.first -%}{{- state.head -}}{%- endif -%}
  {{- turn_text(message['content']) -}}
  {{- '<end_of_turn>\\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<start_of_turn>model\\n' -}}{%- endif -%}
"""


FAMILY = Family(
    name="gemma3",
    model_types=("gemma3", "gemma3_text"),
    hf=HFFacts(default_context=131_072, default_window=4096, nested="gemma3"),
    gguf=GGUFFacts(
        arch="gemma3",
        model_type="gemma3_text",
        hf_class="Gemma3ForCausalLM",
        translate=translate,
        tensors=TENSORS,
        layout=layout,
        window=True,
        vocab_by_position=True,
    ),
    tool_parser="gemma",
    chat_template=CHAT_TEMPLATE,
)
