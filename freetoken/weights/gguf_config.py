"""GGUF metadata -> a Hugging Face style config dict.

Owns the translation of a GGUF file's architecture keys into the keys transformers' config
classes use (`LlamaConfig`, `Gemma3TextConfig`, `GptOssConfig`), so the rest of FreeToken reads
one config format whatever the checkpoint. The dict also always carries `layer_types` (one of
"full_attention" / "sliding_attention" per layer) and `sliding_window` (None without SWA layers).

What the files omit is filled in with the rules llama.cpp itself applies:

- Gemma 3: every 6th layer is global (layers 5, 11, 17, ...), the others slide; rope base 10000
  on sliding layers and the file's `rope.freq_base` on global ones; `query_pre_attn_scalar` is
  head_dim (hidden / heads for the 62-layer 27B model); no soft-capping unless the file says so.
- gpt-oss: layers alternate sliding / full starting with sliding; YaRN with beta_fast 32,
  beta_slow 1, no truncation of the correction range (as the model's own config.json); clamped
  SwiGLU with alpha 1.702 and limit 7.0.
- qwen3 / qwen3moe: every layer full; head_dim from `attention.key_length`; qwen3moe renormalises
  its top-k router weights (llama.cpp always does: `norm_topk_prob`), and a layer without
  `ffn_gate_inp` has a dense MLP (`mlp_only_layers`).
- gemma4: the per-layer `attention.sliding_window_pattern` (true = sliding) and
  `attention.head_count_kv`; `key_length` is the full layers' head_dim, `key_length_swa` the
  sliding ones'; rope `freq_base` on full layers (proportional, a quarter of the pairs turning:
  the converter's `rope_freqs` tensor says so but is not read), `freq_base_swa` (default 10000)
  on sliding ones; a full layer without `attn_v` reuses its keys as values (`attention_k_eq_v`);
  experts when the file has `ffn_gate_inp`.

It reads no tensor data and looks at tensor names only for tied embeddings (`output.weight`) and
the Qwen3-MoE / Gemma 4 layer structure above.
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection, Mapping

from freetoken.errors import ModelLoadError
from freetoken.weights.architectures import check_architecture

FULL = "full_attention"
SLIDING = "sliding_attention"

GEMMA3_SWA_PATTERN = 6  # one global layer per 6; llama.cpp's set_swa_pattern(6)
GEMMA3_LOCAL_ROPE_BASE = 10_000.0
GEMMA3_27B_LAYERS = 62
GPT_OSS_SWIGLU_ALPHA = 1.702
GPT_OSS_SWIGLU_LIMIT = 7.0

GEMMA4_PARTIAL_ROTARY = 0.25
GEMMA4_SWA_ROPE_BASE = 10_000.0

_MODEL_TYPE = {
    "llama": "llama",
    "gemma3": "gemma3_text",
    "gpt-oss": "gpt_oss",
    "qwen3": "qwen3",
    "qwen3moe": "qwen3_moe",
    "gemma4": "gemma4_text",
    "qwen2": "qwen2",
    "qwen35": "qwen3_5_text",
    "qwen35moe": "qwen3_5_moe_text",
}
_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "gpt-oss": "GptOssForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "gemma4": "Gemma4ForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen35": "Qwen3_5ForCausalLM",
    "qwen35moe": "Qwen3_5MoeForCausalLM",
}

_MISSING = object()
MAX_COUNT = 1 << 26  # any size or count in the metadata (a 64M-token context is past every model here)


class _Keys:
    """Typed access to `<arch>.<key>` metadata with one-line errors for missing keys."""

    def __init__(self, metadata: Mapping[str, object], arch: str) -> None:
        self.md = metadata
        self.arch = arch

    def raw(self, key: str, default: object = _MISSING) -> object:
        full = key if key.startswith(("general.", "tokenizer.")) else f"{self.arch}.{key}"
        if full in self.md:
            return self.md[full]
        if default is _MISSING:
            raise ModelLoadError(f"GGUF metadata lacks {full}")
        return default

    def full(self, key: str) -> str:
        return key if key.startswith(("general.", "tokenizer.")) else f"{self.arch}.{key}"

    def integer(self, key: str, default: object = _MISSING) -> int:
        value = self.raw(key, default)
        if isinstance(value, list) and value:  # some files store per-layer values; the models here are uniform
            value = max(value, key=lambda v: v if _is_int(v) else 0)
        if not _is_int(value):
            raise ModelLoadError(f"{self.full(key)} is {_kind(value)}, not an integer")
        return int(value)  # type: ignore[arg-type]

    def count(self, key: str, default: object = _MISSING) -> int:
        """A size or count: an integer in [1, MAX_COUNT] (each entry, for a per-layer list)."""
        value = self.raw(key, default)
        for v in value if isinstance(value, list) else [value]:
            if not _is_int(v) or not 1 <= v <= MAX_COUNT:  # type: ignore[operator]
                raise ModelLoadError(f"{self.full(key)} is {_kind(v)}; it must be an integer from 1 to {MAX_COUNT}")
        return self.integer(key, default)

    def real(self, key: str, default: object = _MISSING) -> float:
        value = self.raw(key, default)
        if not _is_int(value) and not isinstance(value, float) or not math.isfinite(float(value)):  # type: ignore[arg-type]
            raise ModelLoadError(f"{self.full(key)} is {_kind(value)}, not a finite number")
        return float(value)  # type: ignore[arg-type]

    def positive(self, key: str, default: object = _MISSING) -> float:
        """A scale (a rope base or factor, a soft-cap): a finite number above 0."""
        value = self.real(key, default)
        if value <= 0:
            raise ModelLoadError(f"{self.full(key)} is {value!r}; it must be above 0")
        return value

    def optional_positive(self, key: str) -> float | None:
        return None if self.raw(key, None) is None else self.positive(key)

    def optional_integer(self, key: str) -> int | None:
        return None if self.raw(key, None) is None else self.integer(key)

    def optional_real(self, key: str) -> float | None:
        return None if self.raw(key, None) is None else self.real(key)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _kind(value: object) -> str:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return repr(value)
    if isinstance(value, list):
        return f"a list of {len(value)}"
    return f"a {type(value).__name__}"


def architecture_of(metadata: Mapping[str, object]) -> str:
    arch = metadata.get("general.architecture")
    if not isinstance(arch, str):
        raise ModelLoadError("GGUF metadata lacks general.architecture")
    check_architecture(arch)
    return arch


def _vocab_size(k: _Keys) -> int:
    tokens = k.raw("tokenizer.ggml.tokens", None)
    if isinstance(tokens, list) and tokens:
        return len(tokens)
    return k.count("vocab_size")


def _common(k: _Keys, tensor_names: Collection[str]) -> dict[str, object]:
    heads = k.count("attention.head_count")
    return {
        "model_type": _MODEL_TYPE[k.arch],
        "architectures": [_ARCHITECTURES[k.arch]],
        "vocab_size": _vocab_size(k),
        "hidden_size": k.count("embedding_length"),
        "num_hidden_layers": k.count("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": k.count("attention.head_count_kv", heads),
        "max_position_embeddings": k.count("context_length"),
        "rms_norm_eps": k.real("attention.layer_norm_rms_epsilon"),
        "bos_token_id": k.optional_integer("tokenizer.ggml.bos_token_id"),
        "eos_token_id": k.optional_integer("tokenizer.ggml.eos_token_id"),
        "pad_token_id": k.optional_integer("tokenizer.ggml.padding_token_id"),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_dropout": 0.0,
    }


def _llama(k: _Keys, cfg: dict[str, object]) -> None:
    hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])  # type: ignore[arg-type]
    head_dim = k.count("rope.dimension_count", k.integer("attention.key_length", hidden // heads))
    layers = int(cfg["num_hidden_layers"])  # type: ignore[arg-type]
    rope: dict[str, object] = {"rope_type": "default", "rope_theta": k.positive("rope.freq_base", 10_000.0)}
    if k.raw("rope.scaling.type", None) == "linear":
        rope.update(rope_type="linear", factor=k.positive("rope.scaling.factor"))
    cfg.update(
        intermediate_size=k.count("feed_forward_length"),
        head_dim=head_dim,
        hidden_act="silu",
        rope_parameters=rope,
        attention_bias=False,
        mlp_bias=False,
        pretraining_tp=1,
        layer_types=[FULL] * layers,
        sliding_window=None,
    )


def _gemma3_layer_types(k: _Keys, layers: int) -> list[str]:
    pattern = k.raw("attention.sliding_window_pattern", GEMMA3_SWA_PATTERN)
    if isinstance(pattern, list):  # per-layer flags, true = sliding
        if len(pattern) != layers:
            raise ModelLoadError(
                f"{k.arch}.attention.sliding_window_pattern has {len(pattern)} entries for {layers} layers"
            )
        return [SLIDING if flag else FULL for flag in pattern]
    n = k.count("attention.sliding_window_pattern", GEMMA3_SWA_PATTERN)
    return [FULL if (i + 1) % n == 0 else SLIDING for i in range(layers)]


def _gemma3(k: _Keys, cfg: dict[str, object]) -> None:
    layers = int(cfg["num_hidden_layers"])  # type: ignore[arg-type]
    head_dim = k.count("attention.key_length", 256)
    hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])  # type: ignore[arg-type]
    full_rope: dict[str, object] = {"rope_type": "default", "rope_theta": k.positive("rope.freq_base", 1_000_000.0)}
    if k.raw("rope.scaling.type", None) == "linear":
        full_rope.update(rope_type="linear", factor=k.positive("rope.scaling.factor"))
    cfg.update(
        intermediate_size=k.count("feed_forward_length"),
        head_dim=head_dim,
        hidden_activation="gelu_pytorch_tanh",
        rope_parameters={SLIDING: {"rope_type": "default", "rope_theta": GEMMA3_LOCAL_ROPE_BASE}, FULL: full_rope},
        attention_bias=False,
        query_pre_attn_scalar=hidden // heads if layers == GEMMA3_27B_LAYERS else head_dim,
        sliding_window=k.count("attention.sliding_window"),
        layer_types=_gemma3_layer_types(k, layers),
        final_logit_softcapping=k.optional_positive("final_logit_softcapping"),
        attn_logit_softcapping=k.optional_positive("attn_logit_softcapping"),
        use_bidirectional_attention=False,
    )


def _gpt_oss(k: _Keys, cfg: dict[str, object]) -> None:
    layers = int(cfg["num_hidden_layers"])  # type: ignore[arg-type]
    rope: dict[str, object] = {"rope_type": "default", "rope_theta": k.positive("rope.freq_base", 150_000.0)}
    if k.raw("rope.scaling.type", None) == "yarn":
        rope.update(
            rope_type="yarn",
            factor=k.positive("rope.scaling.factor"),
            original_max_position_embeddings=k.count("rope.scaling.original_context_length", 4096),
            beta_fast=32.0,
            beta_slow=1.0,
            truncate=False,
        )
    cfg.update(
        intermediate_size=k.integer("expert_feed_forward_length", k.integer("feed_forward_length", 0)),
        head_dim=k.count("attention.key_length"),
        num_local_experts=k.count("expert_count"),
        num_experts_per_tok=k.count("expert_used_count"),
        hidden_act="silu",
        rope_parameters=rope,
        attention_bias=True,
        sliding_window=k.count("attention.sliding_window"),
        layer_types=[SLIDING if i % 2 == 0 else FULL for i in range(layers)],
        swiglu_alpha=GPT_OSS_SWIGLU_ALPHA,
        swiglu_limit=GPT_OSS_SWIGLU_LIMIT,
    )
    if cfg["intermediate_size"] < 1:  # type: ignore[operator]
        raise ModelLoadError("GGUF metadata lacks gpt-oss.expert_feed_forward_length")


def _scaled_rope(k: _Keys, theta: float) -> dict[str, object]:
    """The file's rope: default, or linear / YaRN scaling when `rope.scaling.type` says so."""
    rope: dict[str, object] = {"rope_type": "default", "rope_theta": k.positive("rope.freq_base", theta)}
    kind = k.raw("rope.scaling.type", None)
    if kind == "linear":
        rope.update(rope_type="linear", factor=k.positive("rope.scaling.factor"))
    elif kind == "yarn":
        rope.update(
            rope_type="yarn",
            factor=k.positive("rope.scaling.factor"),
            original_max_position_embeddings=k.count("rope.scaling.original_context_length"),
        )
    return rope


def _qwen2(k: _Keys, cfg: dict[str, object]) -> None:
    """Qwen2 / Qwen2.5: llama.cpp's `qwen2` (q/k/v biases, NeoX rope, rows not permuted)."""
    hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])  # type: ignore[arg-type]
    cfg.update(
        intermediate_size=k.count("feed_forward_length"),
        head_dim=hidden // heads,
        hidden_act="silu",
        rope_parameters=_scaled_rope(k, 1_000_000.0),
        layer_types=[FULL] * int(cfg["num_hidden_layers"]),  # type: ignore[call-overload]
        sliding_window=None,
        use_sliding_window=False,
    )


def _qwen3(k: _Keys, cfg: dict[str, object], tensor_names: Collection[str]) -> None:
    hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])  # type: ignore[arg-type]
    layers = int(cfg["num_hidden_layers"])  # type: ignore[arg-type]
    cfg.update(
        intermediate_size=k.integer("feed_forward_length", k.integer("expert_feed_forward_length", 0)),
        head_dim=k.count("attention.key_length", hidden // heads),
        hidden_act="silu",
        rope_parameters=_scaled_rope(k, 1_000_000.0),
        attention_bias=False,
        layer_types=[FULL] * layers,
        sliding_window=None,
        use_sliding_window=False,
    )
    if k.arch == "qwen3moe":
        cfg.update(
            num_experts=k.count("expert_count"),
            num_experts_per_tok=k.count("expert_used_count"),
            moe_intermediate_size=k.count("expert_feed_forward_length"),
            norm_topk_prob=bool(k.raw("expert_weights_norm", True)),
            decoder_sparse_step=1,
            mlp_only_layers=[i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensor_names],
        )


def _qwen35(k: _Keys, cfg: dict[str, object]) -> None:
    """Qwen3.5 / Qwen3.5-MoE: linear layers from `attention.recurrent_layers` (else every
    `full_attention_interval`-th layer is full), their shape from the `ssm.*` keys, rope over
    `rope.dimension_count` of each head."""
    layers = int(cfg["num_hidden_layers"])  # type: ignore[arg-type]
    head_dim = k.count("attention.key_length")
    recurrent = k.raw("attention.recurrent_layers", None)
    if isinstance(recurrent, (list, tuple)) and len(recurrent) >= layers:
        layer_types = ["linear_attention" if bool(r) else FULL for r in list(recurrent)[:layers]]
    else:
        interval = k.count("full_attention_interval", 4)
        layer_types = [FULL if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)]
    value_heads = k.count("ssm.time_step_rank")
    cfg.update(
        intermediate_size=k.integer("feed_forward_length", 0),
        head_dim=head_dim,
        hidden_act="silu",
        attention_bias=False,
        layer_types=layer_types,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": k.positive("rope.freq_base", 10_000_000.0),
            "partial_rotary_factor": k.count("rope.dimension_count", head_dim // 4) / head_dim,
        },
        linear_conv_kernel_dim=k.count("ssm.conv_kernel"),
        linear_key_head_dim=k.count("ssm.state_size"),
        linear_num_key_heads=k.count("ssm.group_count"),
        linear_num_value_heads=value_heads,
        linear_value_head_dim=k.count("ssm.inner_size") // value_heads,
    )
    if k.arch == "qwen35moe":
        cfg.update(
            num_experts=k.count("expert_count"),
            num_experts_per_tok=k.count("expert_used_count"),
            moe_intermediate_size=k.count("expert_feed_forward_length"),
            shared_expert_intermediate_size=k.count("expert_shared_feed_forward_length"),
        )


def _per_layer(k: _Keys, key: str, layers: int) -> list[object]:
    value = k.raw(key)
    if not isinstance(value, list):
        return [value] * layers
    if len(value) != layers:
        raise ModelLoadError(f"{k.arch}.{key} has {len(value)} entries for {layers} layers")
    return value


def _gemma4(k: _Keys, cfg: dict[str, object], tensor_names: Collection[str]) -> None:
    layers = int(cfg["num_hidden_layers"])  # type: ignore[arg-type]
    if k.integer("embedding_length_per_layer_input", 0) or k.integer("attention.shared_kv_layers", 0):
        raise ModelLoadError("gemma4 with per-layer embeddings or shared KV layers (Gemma 4 E2B/E4B) is not supported")
    sliding = [bool(flag) for flag in _per_layer(k, "attention.sliding_window_pattern", layers)]
    k.count("attention.head_count_kv")  # every entry a positive integer
    kv_heads = [int(h) for h in _per_layer(k, "attention.head_count_kv", layers)]  # type: ignore[call-overload]
    full = [i for i in range(layers) if not sliding[i]]
    swa = [i for i in range(layers) if sliding[i]]
    moe = any(f"blk.{i}.ffn_gate_inp.weight" in tensor_names for i in range(layers))
    cfg.update(
        intermediate_size=k.count("feed_forward_length"),
        head_dim=k.count("attention.key_length_swa", k.integer("attention.key_length")),
        global_head_dim=k.count("attention.key_length"),
        num_key_value_heads=kv_heads[swa[0]] if swa else kv_heads[0],
        num_global_key_value_heads=kv_heads[full[0]] if full else None,
        attention_k_eq_v=any(f"blk.{i}.attn_v.weight" not in tensor_names for i in full),
        hidden_activation="gelu_pytorch_tanh",
        rope_parameters={
            SLIDING: {"rope_type": "default", "rope_theta": k.positive("rope.freq_base_swa", GEMMA4_SWA_ROPE_BASE)},
            FULL: {
                "rope_type": "proportional",
                "partial_rotary_factor": GEMMA4_PARTIAL_ROTARY,
                "rope_theta": k.positive("rope.freq_base", 1_000_000.0),
            },
        },
        attention_bias=False,
        sliding_window=k.count("attention.sliding_window"),
        layer_types=[SLIDING if s else FULL for s in sliding],
        final_logit_softcapping=k.optional_positive("final_logit_softcapping"),
        hidden_size_per_layer_input=0,
        num_kv_shared_layers=0,
        enable_moe_block=moe,
        num_experts=k.count("expert_count") if moe else None,
        top_k_experts=k.count("expert_used_count") if moe else None,
        moe_intermediate_size=k.count("expert_feed_forward_length") if moe else None,
    )
    if len({kv_heads[i] for i in full}) > 1 or len({kv_heads[i] for i in swa}) > 1:
        raise ModelLoadError(f"gemma4.attention.head_count_kv varies within a layer kind: {kv_heads}")


def hf_config_from_metadata(metadata: Mapping[str, object], tensor_names: Collection[str]) -> dict[str, object]:
    """The HF config dict for a GGUF file's metadata and tensor names.

    Raises ModelLoadError "unsupported architecture: X" for other architectures, and for missing
    required keys.
    """
    arch = architecture_of(metadata)
    k = _Keys(metadata, arch)
    cfg = _common(k, tensor_names)
    if arch in ("qwen3", "qwen3moe"):
        _qwen3(k, cfg, tensor_names)
    elif arch == "gemma4":
        _gemma4(k, cfg, tensor_names)
    elif arch in ("qwen35", "qwen35moe"):
        _qwen35(k, cfg)
    else:
        {"llama": _llama, "gemma3": _gemma3, "gpt-oss": _gpt_oss, "qwen2": _qwen2}[arch](k, cfg)
    _check_relations(k, cfg)
    return cfg


def _check_relations(k: _Keys, cfg: Mapping[str, object]) -> None:
    heads, kv_heads = int(cfg["num_attention_heads"]), int(cfg["num_key_value_heads"])  # type: ignore[call-overload]
    if heads % kv_heads:
        raise ModelLoadError(
            f"{k.full('attention.head_count_kv')} {kv_heads} does not divide {k.full('attention.head_count')} {heads}"
        )
    for total, used, name in (
        ("num_local_experts", "num_experts_per_tok", "expert"),
        ("num_experts", "num_experts_per_tok", "expert"),
        ("num_experts", "top_k_experts", "expert"),
    ):
        if cfg.get(total) is not None and cfg.get(used) is not None and int(cfg[used]) > int(cfg[total]):  # type: ignore[call-overload]
            raise ModelLoadError(
                f"{k.full(name + '_used_count')} {cfg[used]} is more than {k.full(name + '_count')} {cfg[total]}"
            )


_BLOCK = re.compile(r"blk\.(\d+)\.")


def check_tensor_shapes(
    metadata: Mapping[str, object], cfg: Mapping[str, object], shapes: Mapping[str, tuple[int, ...]]
) -> None:
    """The config agrees with the tensors the file holds, so that nothing sized from the metadata
    (layers, embedding, heads, MLP) is built larger than the file: `block_count` is the number of
    `blk.N` blocks present (0..N-1, none missing; a file with no blocks has at most one per tensor), and the embedding width, the query / key rows
    and the MLP width are those of the tensors. Shapes are in torch order (outermost first)."""
    k = _Keys(metadata, architecture_of(metadata))
    layers = int(cfg["num_hidden_layers"])  # type: ignore[call-overload]
    blocks = {int(m[1]) for name in shapes if (m := _BLOCK.match(name))}
    if blocks and blocks != set(range(layers)):
        present = (
            f"blocks 0..{max(blocks)}" if blocks == set(range(max(blocks) + 1)) else f"{len(blocks)} scattered blocks"
        )
        raise ModelLoadError(f"{k.full('block_count')} is {layers} but the file has tensors for {present}")
    if layers > len(shapes):  # no blk.N tensor at all (a weights-only file): at most one layer per tensor
        raise ModelLoadError(f"{k.full('block_count')} is {layers} but the file has only {len(shapes)} tensors")
    hidden = int(cfg["hidden_size"])  # type: ignore[call-overload]
    embd = shapes.get("token_embd.weight")  # a missing one is named with the other missing weights, at load
    if embd is not None and (len(embd) != 2 or embd[1] != hidden):
        raise ModelLoadError(f"{k.full('embedding_length')} is {hidden} but token_embd.weight has shape {list(embd)}")
    vocab = int(cfg["vocab_size"])  # type: ignore[call-overload]
    if embd is not None and embd[0] < vocab:
        raise ModelLoadError(f"the vocabulary has {vocab} tokens but token_embd.weight has only {embd[0]} rows")
    if k.arch in ("gemma4", "qwen35", "qwen35moe"):
        return  # per-layer head sizes (Qwen3.5: q rows hold the output gate too): checked when the weights are loaded
    head_dim = int(cfg["head_dim"])  # type: ignore[call-overload]
    want = {
        "attn_q.weight": (int(cfg["num_attention_heads"]) * head_dim, "attention.head_count"),  # type: ignore[call-overload]
        "attn_k.weight": (int(cfg["num_key_value_heads"]) * head_dim, "attention.head_count_kv"),  # type: ignore[call-overload]
        "ffn_up.weight": (int(cfg["intermediate_size"]), "feed_forward_length"),  # type: ignore[call-overload]
    }
    for i in range(layers):
        for suffix, (rows, key) in want.items():
            shape = shapes.get(f"blk.{i}.{suffix}")
            if shape is not None and (len(shape) != 2 or shape[0] != rows or shape[1] != hidden):
                raise ModelLoadError(
                    f"{k.full(key)} (with the head size and width) gives {rows} rows but blk.{i}.{suffix} has shape {list(shape)}"
                )
