"""What a model family tells the layers below the models: the `Family` record and its parts.

Owns `Family` (each family module's `FAMILY`: its names, how tensor parallelism splits it, its
tool-call format and built-in chat template), `GGUFFacts` (its GGUF architecture: the name, the HF
model_type and class it becomes, the metadata translator, the tensor-name table, the layout hooks
and how its vocabulary ranks merges), `HFFacts` (what the API process's preflight reads from a
`config.json`), the names of the tensor rearrangements the weights package applies
(`UNPERMUTE_Q_ROWS`, ...) and of the tensor-parallel splits (`SPLIT_WIDTH`, `SPLIT_EXPERTS`), and
the pieces of GGUF translation that several families share. It holds no family, imports no torch
(the API process imports it) and knows nothing of the model code: the torch side of each
rearrangement is in `weights/names.py`, of each split in `models/shard.py`, the model class in
`models/registry.py`.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass

from freetoken.families.gguf_keys import Keys

FULL = "full_attention"
SLIDING = "sliding_attention"

# The rearrangements of a GGUF tensor's values into HF's layout, by name (a family's `layout`
# returns one for a tensor; `weights/names.py` does it):
UNPERMUTE_Q_ROWS = "unpermute_q_rows"  # undo llama.cpp's rotary row permutation of q_proj (per query head)
UNPERMUTE_K_ROWS = "unpermute_k_rows"  # the same for k_proj (per kv head)
NORM_MINUS_ONE = "norm_minus_one"  # an RMSNorm weight stored as w + 1: subtract 1 (and never keep it quantized)
EXPERTS_TRANSPOSE = "experts_transpose"  # ggml [E, out, in] -> [E, in, out]
# a one-row matrix ([1, H]: a gate with a single output): llama.cpp's converter writes it [1, H], but
# a file llama.cpp itself rewrites (llama-quantize) stores only the dimensions up to the last that
# is not 1, so there it is [H]; either comes back as [1, H]
ONE_ROW = "one_row"
# Qwen3.5's linear-attention tensors: llama.cpp's converter tiles the value heads (head j of key
# group g at j * key_heads + g) where HF groups them (g * value_heads / key_heads + j); the
# rearrangements below put them back, on what each tensor holds per value head:
LINEAR_QKV_ROWS = "linear_qkv_rows"  # rows: q and k rows as they are, then v rows (value head dim each)
LINEAR_CONV = "linear_conv"  # LINEAR_QKV_ROWS's channels of a [C, K] kernel, then HF's [C, 1, K]
LINEAR_V_ROWS = "linear_v_rows"  # rows: value head dim rows per value head (the output gate z)
LINEAR_V_SCALARS = "linear_v_scalars"  # one row or value per value head (alpha, beta, dt bias)
LINEAR_A_LOG = "linear_a_log"  # LINEAR_V_SCALARS of -exp(A_log), stored as is: log(-x)
LINEAR_V_COLUMNS = "linear_v_columns"  # columns: value head dim columns per value head (out_proj)
# the same two without the value heads' reordering (Qwen3-Next: its converter keeps HF's order)
A_LOG = "a_log"  # -exp(A_log), stored as is: log(-x)
CONV_KERNEL = "conv_kernel"  # a depthwise kernel [C, K] -> HF's [C, 1, K]

# How an expert's separate gate / up stacks become HF's gate_up_proj:
ROWS = "rows"  # gate rows, then up rows (a fused stack is already so)
INTERLEAVE = "interleave"  # on the last axis, gate at even indices (a fused stack, gate half first, too)

# How `models/shard.py` splits a family's model over tensor-parallel ranks (`Family.tensor_parallel`;
# None: it has no shard plan, and `--tensor-parallel-size` above 1 is refused):
SPLIT_WIDTH = "width"  # heads, KV heads, MLP (and experts') columns, vocabulary rows
SPLIT_EXPERTS = "experts"  # as SPLIT_WIDTH, but the experts whole: each rank holds E / N of them (expert parallelism)

Translate = Callable[[Keys, dict[str, object], Collection[str]], None]


def no_layout(rest: str) -> str | None:
    """Every tensor keeps the file's layout."""
    return None


@dataclass(frozen=True)
class GGUFFacts:
    """A family's GGUF architecture (`general.architecture`), and how its files become HF's.

    `translate(keys, cfg, tensor_names)` adds the family's keys to `cfg`, the HF config dict that
    `weights/gguf_config.py` starts with the keys every architecture shares (model_type, vocab,
    widths, heads, context, norm epsilon, token ids, tied embeddings); it must set `layer_types`
    and `sliding_window`. `tensors` maps a layer tensor's name after `blk.N.` to the HF name after
    `model.layers.N.` (the global tensors, embedding / final norm / output, are the same for every
    family). `layout(rest)` names the rearrangement of the layer tensor `rest`, or None.
    """

    arch: str  # general.architecture, as llama.cpp writes it ("gpt-oss", "qwen3moe")
    model_type: str  # the HF config's model_type
    hf_class: str  # the HF config's architectures[0]
    translate: Translate
    tensors: Mapping[str, str]
    layout: Callable[[str], str | None] = no_layout
    experts_join: str = ROWS  # ROWS or INTERLEAVE
    window: bool = False  # preflight reads `<arch>.attention.sliding_window` (else: no sliding layers)
    uniform_heads: bool = True  # False: head sizes vary per layer, the q/k shape check waits for the load
    # layer tensors (names after `blk.N.`) the model holds in float32 under a half `--dtype`
    # (routers): handed over in float32, not rounded to the half type on the way
    float32: frozenset[str] = frozenset()
    # a SentencePiece vocabulary (`tokenizer.ggml.model` "llama") laid out in merge order: the file
    # position, not the score, ranks the merges, and runs of spaces are stored as spaces (Gemma's;
    # transformers' GGUF converter for the family does the same)
    vocab_by_position: bool = False


@dataclass(frozen=True)
class HFFacts:
    """What the API process's preflight reads from a `config.json` of the family, without torch:
    the context and window when the file leaves them out (the transformers class defaults)."""

    default_context: int
    default_window: int | None
    switched_window: bool = False  # `sliding_window` counts only when `use_sliding_window` is true (Qwen2/3)
    nested: str | None = None  # the model_type whose config.json holds the text model in `text_config`


@dataclass(frozen=True)
class Family:
    """One model family: `name` is `ModelConfig.architecture`; `model_types` the `config.json`
    model_types its reader (in `models/`) reads; `hf` None where preflight does not know it yet;
    `gguf` None for a family that loads from safetensors only."""

    name: str
    model_types: tuple[str, ...]
    hf: HFFacts | None
    gguf: GGUFFacts | None = None
    tensor_parallel: str | None = SPLIT_WIDTH  # SPLIT_WIDTH, SPLIT_EXPERTS, or None: no shard plan
    # the tool-call format (a `--tool-call-parser` name) of a model whose chat template and
    # vocabulary show none; None: the registry's default (tokenizer/tool_parsers/registry.py)
    tool_parser: str | None = None
    # the chat template of a model of the family that ships none (a base model); None: none built in
    chat_template: str | None = None

    @property
    def names(self) -> tuple[str, ...]:
        """Every name the family goes by: its own, its model_types, its GGUF architecture."""
        arch = (self.gguf.arch,) if self.gguf is not None else ()
        return tuple(dict.fromkeys((self.name, *self.model_types, *arch)))


# --- pieces several families' GGUF facts share ------------------------------------------------

ATTENTION: dict[str, str] = {
    f"attn_{g}.{kind}": f"self_attn.{h}_proj.{kind}"
    for g, h in (("q", "q"), ("k", "k"), ("v", "v"), ("output", "o"))
    for kind in ("weight", "bias")
}

DENSE_MLP: dict[str, str] = {
    f"ffn_{p}.{kind}": f"mlp.{p}_proj.{kind}" for p in ("gate", "up", "down") for kind in ("weight", "bias")
}


def scaled_rope(k: Keys, theta: float) -> dict[str, object]:
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


def layers_of(cfg: Mapping[str, object]) -> int:
    return int(cfg["num_hidden_layers"])  # type: ignore[call-overload]
