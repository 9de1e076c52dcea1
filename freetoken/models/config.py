"""Model configuration: one frozen dataclass for every supported family.

Owns `ModelConfig` and `RopeConfig`, and the pieces of reading a Hugging Face `config.json` dict
that every family shares (as transformers 5.x writes it, and the older keys `rope_theta` /
`rope_local_base_freq` / `rope_scaling`): `hf_get`, `read_rope`, `read_single_rope`,
`read_common`. Each family's own reader (its transformers class defaults and what it derives) is
`config_from_hf` in the family's module; `registry.config_from_hf` picks one by `model_type`. It
does not read GGUF metadata (the weights package turns that into a `config.json` dict) and holds
no weights.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from freetoken.errors import ModelLoadError
from freetoken.families import all_families
from freetoken.kv.tensors import KVLayout

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
LINEAR_ATTENTION = "linear_attention"  # Gated DeltaNet (Qwen3.5): a recurrent state per request, no K/V pages
ARCHITECTURES = tuple(f.name for f in all_families())  # one per module of freetoken/families/

# "proportional" (Gemma 4's full layers): default frequencies on the first partial_rotary_factor
# of each head's rotary pairs, zero (no rotation) on the rest.
_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "proportional")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding of one layer kind. Fields other than `theta` matter only for scaled types:
    `factor` (linear, llama3, yarn), `original_max_position_embeddings` (llama3, yarn),
    `low_freq_factor`/`high_freq_factor` (llama3), `beta_fast`/`beta_slow`/`truncate`/
    `attention_factor`/`mscale`/`mscale_all_dim` (yarn), `partial_rotary_factor` (proportional)."""

    theta: float
    rope_type: str = "default"
    factor: float | None = None
    original_max_position_embeddings: int | None = None
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    truncate: bool = True
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    partial_rotary_factor: float | None = None


@dataclass(frozen=True)
class ModelConfig:
    """Everything the model code needs to know about a checkpoint's architecture."""

    architecture: str  # one of ARCHITECTURES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    layer_types: tuple[str, ...]  # FULL_ATTENTION / SLIDING_ATTENTION / LINEAR_ATTENTION per layer
    rope_full: RopeConfig  # rope of full-attention layers
    rope_sliding: RopeConfig  # rope of sliding-window layers (== rope_full where one rope is used)
    sliding_window: int | None = None  # W: keys a query sees, itself included (q - k < W)
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    attention_bias: bool = False
    o_proj_bias: bool | None = None  # o_proj's bias where it differs from q/k/v's (Qwen2: False); None: attention_bias
    mlp_bias: bool = False
    query_pre_attn_scalar: float | None = None  # attention scale is its -0.5 power when set
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    num_experts: int = 0
    num_experts_per_tok: int = 0
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    moe_intermediate_size: int = 0  # one expert's width where it differs from the dense MLP's (Qwen3-MoE, Gemma 4)
    norm_topk_prob: bool = False  # renormalise the top-k router probabilities to sum to 1 (Qwen3-MoE)
    dense_mlp_layers: tuple[int, ...] = ()  # MoE models: layers with a dense MLP instead of experts
    global_head_dim: int | None = None  # Gemma 4: head_dim of full-attention layers (head_dim: sliding ones)
    num_global_kv_heads: int | None = None  # Gemma 4: kv heads of full-attention layers
    attention_k_eq_v: bool = False  # Gemma 4: full layers have no v_proj; values are the keys' projection
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    # Qwen3.5: the gated attention's query projection also yields a per-channel output gate, and
    # the linear-attention (Gated DeltaNet) layers' shape; `shared_expert_intermediate_size` is the
    # MoE's always-on expert beside the routed ones.
    attn_output_gate: bool = False
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    shared_expert_intermediate_size: int = 0
    # GLM-4.5 MoE: q/k head norms where the config asks (`use_qk_norm`), and its router's groups
    # (experts chosen among the best `topk_group` of `n_group` groups) and output scale.
    qk_norm: bool = False
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise ModelLoadError(f"unsupported architecture {self.architecture!r}")
        if len(self.layer_types) != self.num_layers:
            raise ModelLoadError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
        bad = sorted(set(self.layer_types) - {FULL_ATTENTION, SLIDING_ATTENTION, LINEAR_ATTENTION})
        if bad:
            raise ModelLoadError(f"unsupported layer types {bad}")
        if self.has_swa and (self.sliding_window is None or self.sliding_window < 1):
            raise ModelLoadError("the model has sliding-window layers but no valid sliding_window")
        if self.num_heads % self.num_kv_heads != 0:
            raise ModelLoadError(f"{self.num_heads} heads are not a multiple of {self.num_kv_heads} kv heads")
        for rope in (self.rope_full, self.rope_sliding):
            if rope.rope_type not in _ROPE_TYPES:
                raise ModelLoadError(f"unsupported rope type {rope.rope_type!r}")

    @property
    def has_swa(self) -> bool:
        return SLIDING_ATTENTION in self.layer_types

    @property
    def swa_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == SLIDING_ATTENTION)

    @property
    def has_linear(self) -> bool:
        """A hybrid model: some layers are linear attention with a recurrent state (Qwen3.5)."""
        return LINEAR_ATTENTION in self.layer_types

    @property
    def linear_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR_ATTENTION)

    @property
    def linear_conv_dim(self) -> int:
        """Channels of a linear layer's convolution: queries, keys and values."""
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + self.linear_num_value_heads * (
            self.linear_value_head_dim
        )

    @property
    def full_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL_ATTENTION)

    def kv_layout(self) -> KVLayout:
        """The shape of this model's paged K/V memory (Gemma 4: full and sliding heads differ)."""
        sliding = tuple(self.is_sliding(i) for i in range(self.num_layers))
        full = self.for_layer(self.full_layers[0]) if self.full_layers else self
        if self.has_linear:
            return KVLayout(
                sliding,
                full.num_kv_heads,
                full.head_dim,
                linear=tuple(t == LINEAR_ATTENTION for t in self.layer_types),
                conv_shape=(self.linear_conv_dim, self.linear_conv_kernel_dim - 1),
                recurrent_shape=(self.linear_num_value_heads, self.linear_key_head_dim, self.linear_value_head_dim),
            )
        if not self.has_swa or (full.num_kv_heads, full.head_dim) == (self.num_kv_heads, self.head_dim):
            return KVLayout(sliding, full.num_kv_heads, full.head_dim)
        return KVLayout(sliding, full.num_kv_heads, full.head_dim, self.num_kv_heads, self.head_dim)

    def for_layer(self, layer: int) -> ModelConfig:
        """This config with `layer`'s attention head shape (only Gemma 4's full layers differ)."""
        if self.is_sliding(layer) or (self.global_head_dim is None and self.num_global_kv_heads is None):
            return self
        return replace(
            self,
            head_dim=self.global_head_dim or self.head_dim,
            num_kv_heads=self.num_global_kv_heads or self.num_kv_heads,
            global_head_dim=None,
            num_global_kv_heads=None,
        )

    def is_sliding(self, layer: int) -> bool:
        return self.layer_types[layer] == SLIDING_ATTENTION

    @property
    def attention_scale(self) -> float:
        base = self.query_pre_attn_scalar if self.query_pre_attn_scalar is not None else self.head_dim
        return float(base) ** -0.5


# --- reading config.json: what every family's reader shares ----------------------------------


def hf_get(config: Mapping[str, Any], key: str, default: Any) -> Any:
    """`config[key]`, or `default` when the key is absent or null."""
    value = config.get(key)
    return default if value is None else value


def read_rope(params: Mapping[str, Any], theta: float) -> RopeConfig:
    """One rope dict (`rope_parameters` entry or legacy `rope_scaling`) over a default theta."""
    rope_type = params.get("rope_type", params.get("type", "default"))

    def opt(key: str) -> float | None:
        value = params.get(key)
        return None if value is None else float(value)

    orig = params.get("original_max_position_embeddings")
    return RopeConfig(
        theta=float(hf_get(params, "rope_theta", theta)),
        rope_type=str(rope_type),
        factor=opt("factor"),
        original_max_position_embeddings=None if orig is None else int(orig),
        low_freq_factor=opt("low_freq_factor"),
        high_freq_factor=opt("high_freq_factor"),
        beta_fast=opt("beta_fast"),
        beta_slow=opt("beta_slow"),
        truncate=bool(params.get("truncate", True)),
        attention_factor=opt("attention_factor"),
        mscale=opt("mscale"),
        mscale_all_dim=opt("mscale_all_dim"),
        partial_rotary_factor=opt("partial_rotary_factor"),
    )


def read_switched_window(config: Mapping[str, Any], num_layers: int) -> tuple[tuple[str, ...], int | None]:
    """(layer types, window or None) of a Qwen2 / Qwen3 config: `sliding_window` counts only when
    `use_sliding_window` is set, and then for the layers from `max_window_layers` on (or as
    `layer_types` lists them, where the file has that)."""
    window = int(hf_get(config, "sliding_window", 4096)) if config.get("use_sliding_window") else None
    layer_types = tuple(
        config.get("layer_types")
        or [
            SLIDING_ATTENTION
            if window is not None and i >= int(hf_get(config, "max_window_layers", 28))
            else FULL_ATTENTION
            for i in range(num_layers)
        ]
    )
    return layer_types, window if SLIDING_ATTENTION in layer_types else None


def read_single_rope(config: Mapping[str, Any], default_theta: float) -> RopeConfig:
    """The one rope of a model whose layers all share it (llama, gpt_oss, qwen3, qwen3_moe)."""
    params = dict(hf_get(config, "rope_parameters", None) or hf_get(config, "rope_scaling", None) or {})
    theta = float(hf_get(config, "rope_theta", default_theta))
    rope = read_rope(params, theta)
    if rope.rope_type in ("llama3", "yarn") and rope.original_max_position_embeddings is None:
        max_pos = int(hf_get(config, "original_max_position_embeddings", config.get("max_position_embeddings", 2048)))
        rope = read_rope({**params, "original_max_position_embeddings": max_pos}, theta)
    return rope


def _eos(config: Mapping[str, Any]) -> tuple[int, ...]:
    eos = config.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(int(e) for e in eos) if isinstance(eos, list) else (int(eos),)


def read_common(config: Mapping[str, Any], defaults: Mapping[str, Any]) -> dict[str, Any]:
    """Fields read the same way for every family; `defaults` are the transformers class defaults
    (hub configs such as Gemma 3's nested text_config rely on them)."""

    def get(key: str) -> Any:
        value = hf_get(config, key, defaults.get(key))
        if value is None and key in _REQUIRED:
            raise ModelLoadError(f"config.json lacks {key!r}")
        return value

    hidden = int(get("hidden_size"))
    heads = int(get("num_attention_heads"))
    return dict(
        vocab_size=int(get("vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(get("intermediate_size")),
        num_layers=int(get("num_hidden_layers")),
        num_heads=heads,
        num_kv_heads=int(hf_get(config, "num_key_value_heads", defaults.get("num_key_value_heads", heads))),
        head_dim=int(hf_get(config, "head_dim", defaults.get("head_dim", hidden // heads))),
        rms_norm_eps=float(get("rms_norm_eps")),
        max_position_embeddings=int(get("max_position_embeddings")),
        tie_word_embeddings=bool(get("tie_word_embeddings")),
        attention_bias=bool(get("attention_bias")),
        bos_token_id=get("bos_token_id"),
        eos_token_ids=_eos({"eos_token_id": get("eos_token_id")}),
        pad_token_id=get("pad_token_id"),
    )


_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
