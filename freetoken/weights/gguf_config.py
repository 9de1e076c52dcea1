"""GGUF metadata -> a Hugging Face style config dict.

Owns the translation of a GGUF file's metadata into the keys transformers' config classes use, so
the rest of FreeToken reads one config format whatever the checkpoint: the keys every architecture
shares here (model_type and class, vocabulary, widths, heads, context, norm epsilon, token ids,
tied embeddings), the rest by the architecture's family (`freetoken.families`: its
`FAMILY.gguf.translate`, which fills in what the files omit as llama.cpp does). The dict always
carries `layer_types` (one of "full_attention" / "sliding_attention" per layer) and
`sliding_window` (None without SWA layers). It also checks the config against the tensors' shapes.

It reads no tensor data and looks at tensor names only for tied embeddings (`output.weight`) and
what a family's translator reads of the layer structure. It holds no family's knowledge.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping

from freetoken.errors import ModelLoadError
from freetoken.families import gguf_facts
from freetoken.families.gguf_keys import Keys


def architecture_of(metadata: Mapping[str, object]) -> str:
    arch = metadata.get("general.architecture")
    if not isinstance(arch, str):
        raise ModelLoadError("GGUF metadata lacks general.architecture")
    gguf_facts(arch)
    return arch


def _vocab_size(k: Keys) -> int:
    tokens = k.raw("tokenizer.ggml.tokens", None)
    if isinstance(tokens, list) and tokens:
        return len(tokens)
    return k.count("vocab_size")


def _common(k: Keys, tensor_names: Collection[str]) -> dict[str, object]:
    heads = k.count("attention.head_count")
    return {
        "model_type": gguf_facts(k.arch).model_type,
        "architectures": [gguf_facts(k.arch).hf_class],
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


def hf_config_from_metadata(metadata: Mapping[str, object], tensor_names: Collection[str]) -> dict[str, object]:
    """The HF config dict for a GGUF file's metadata and tensor names.

    Raises ModelLoadError "unsupported architecture: X" for other architectures, and for missing
    required keys.
    """
    arch = architecture_of(metadata)
    k = Keys(metadata, arch)
    cfg = _common(k, tensor_names)
    gguf_facts(arch).translate(k, cfg, tensor_names)
    _check_relations(k, cfg)
    return cfg


def _check_relations(k: Keys, cfg: Mapping[str, object]) -> None:
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
    k = Keys(metadata, architecture_of(metadata))
    layers = int(cfg["num_hidden_layers"])  # type: ignore[call-overload]
    # a file may also hold trailing multi-token-prediction blocks (counted in block_count; the model ignores them)
    mtp = int(cfg.get("num_nextn_predict_layers") or 0)  # type: ignore[call-overload]
    blocks = {int(m[1]) for name in shapes if (m := _BLOCK.match(name))}
    if blocks and blocks != set(range(layers)) and blocks != set(range(layers + mtp)):
        present = (
            f"blocks 0..{max(blocks)}" if blocks == set(range(max(blocks) + 1)) else f"{len(blocks)} scattered blocks"
        )
        raise ModelLoadError(f"{k.full('block_count')} is {layers + mtp} but the file has tensors for {present}")
    if layers > len(shapes):  # no blk.N tensor at all (a weights-only file): at most one layer per tensor
        raise ModelLoadError(f"{k.full('block_count')} is {layers} but the file has only {len(shapes)} tensors")
    hidden = int(cfg["hidden_size"])  # type: ignore[call-overload]
    embd = shapes.get("token_embd.weight")  # a missing one is named with the other missing weights, at load
    if embd is not None and (len(embd) != 2 or embd[1] != hidden):
        raise ModelLoadError(f"{k.full('embedding_length')} is {hidden} but token_embd.weight has shape {list(embd)}")
    vocab = int(cfg["vocab_size"])  # type: ignore[call-overload]
    if embd is not None and embd[0] < vocab:
        raise ModelLoadError(f"the vocabulary has {vocab} tokens but token_embd.weight has only {embd[0]} rows")
    if not gguf_facts(k.arch).uniform_heads:
        return  # per-layer head sizes: checked when the weights are loaded
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
