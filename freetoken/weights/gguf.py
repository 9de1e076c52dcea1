"""Loading a GGUF checkpoint into HF-named torch tensors (dequantized, or kept in integer form)
and an HF config dict.

Owns the walk over a GGUF file: open it (memory-mapped), check the architecture, the tensor names
and the quant types before decoding anything, then dequantize tensor by tensor into HF names and
layouts. It does not build models, tokenizers or engine configs. Every failure a user can cause
(missing, truncated or corrupt file, unsupported architecture or quant type) is a one-line
ModelLoadError.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from freetoken.errors import ModelLoadError
from freetoken.families import find_gguf
from freetoken.families.base import ROWS
from freetoken.ops.quantized import QuantizedWeight, SuperBlockWeight
from freetoken.weights.dequant import SUPPORTED_TYPES, Deferred, dequantize, gguf_mxfp4_blocks, mxfp4_matrix, type_name
from freetoken.weights.gguf_config import architecture_of, hf_config_from_metadata
from freetoken.weights.gguf_file import GGUFFile, GGUFTensorInfo
from freetoken.weights.gguf_metadata import metadata_of, open_gguf
from freetoken.weights.names import HFTensorAssembler, hf_target
from freetoken.weights.progress import ProgressCallback
from freetoken.weights.requant import INTEGER_TYPES, SUPERBLOCK_TYPES, QType, group_rows, superblock_rows, to_quantized

# Stacked expert matrices kept in their file form (`keep_quantized`): integer types and MXFP4.
EXPERT_TYPES: frozenset[int] = INTEGER_TYPES | {QType.MXFP4}
_EXPERT_STACK = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down|gate_up)_exps\.weight")


def expert_stack_name(gguf_name: str, arch: str = "") -> str | None:
    """`blk.N.ffn_{gate,up,down}_exps.weight` (llama.cpp's name in every MoE architecture) ->
    `model.layers.N.mlp.experts.{gate,up,down}_proj`: FreeToken's name for a list of E per-expert
    matrices [out, in] (`models.experts.Experts.load`); a fused `ffn_gate_up_exps` (Gemma 4's:
    gate rows, then up rows, the family's `experts_join` ROWS) likewise -> `...gate_up_proj`; None
    for any other tensor."""
    m = _EXPERT_STACK.fullmatch(gguf_name)
    if m is None or (m[2] == "gate_up" and not _fused_rows(arch)):  # gpt-oss's fused halves interleave: the assembler's
        return None
    return f"model.layers.{m[1]}.mlp.experts.{m[2]}_proj"


def _fused_rows(arch: str) -> bool:
    """Whether the architecture's files may hold fused gate / up expert stacks laid out as HF's
    gate_up_proj (gate rows, then up rows), so that they can be kept as they are."""
    facts = find_gguf(arch)
    return facts is not None and facts.experts_join == ROWS and "ffn_gate_up_exps.weight" in facts.tensors


def expert_stack(data: np.ndarray, qtype: int, shape: tuple[int, ...], name: str) -> list[Deferred]:
    """A stacked [E, N, K] expert tensor -> E matrices decoded on demand from their slice of the
    memory map (Q4_K / Q6_K in their own integers, other types as group-32 integers exactly; MXFP4
    widened exactly to 8 bits where it can be)."""
    E, N, K = (int(d) for d in shape)
    per = data.shape[0] // E

    def decode(e: int) -> torch.Tensor | QuantizedWeight | SuperBlockWeight:
        raw = data[e * per : (e + 1) * per]
        if qtype == QType.MXFP4:
            return mxfp4_matrix(*gguf_mxfp4_blocks(raw, N, K), f"{name} expert {e}")
        if qtype in SUPERBLOCK_TYPES:
            return superblock_rows(raw, qtype, (N, K), f"{name} expert {e}")
        return to_quantized(raw, qtype, (N, K), f"{name} expert {e}")

    return [Deferred((N, K), per, lambda e=e: decode(e)) for e in range(E)]


@dataclass
class GGUFCheckpoint:
    """What a GGUF file holds, in Hugging Face terms."""

    hf_config: dict[str, object]
    tensors: dict[str, torch.Tensor | QuantizedWeight]  # HF name -> dequantized tensor, or kept in integer form
    metadata: dict[str, object]  # every GGUF key/value, decoded
    quant_types: dict[str, int]  # GGML type name -> number of tensors stored in it


def linear_shape(hf_config: dict[str, object]) -> tuple[int, int, int, int] | None:
    """(key heads, value heads, key dim, value dim) of a Qwen3.5 config's linear layers, else None."""
    keys = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim")
    if any(hf_config.get(k) is None for k in keys):
        return None
    hk, hv, dk, dv = (int(hf_config[k]) for k in keys)  # type: ignore[call-overload]
    return hk, hv, dk, dv


def quant_type_counts(reader: GGUFFile) -> dict[str, int]:
    return dict(Counter(type_name(t.ggml_type) for t in reader.tensors))


def decode_dtype(t: GGUFTensorInfo, dtype: torch.dtype) -> torch.dtype:
    """The dtype to dequantize a tensor into. Matrices go straight to `dtype` (renaming and
    rearranging only move their values); vectors (norms, biases) stay float32 until the assembler
    has rearranged them, since the Gemma norm shift does arithmetic on them."""
    return torch.float32 if len(t.shape) <= 1 else dtype


def _check_tensors(path: Path, arch: str, reader: GGUFFile) -> None:
    """Fail before decoding anything: every tensor must have a known name and a supported type."""
    for t in reader.tensors:
        if t.ggml_type not in SUPPORTED_TYPES:
            raise ModelLoadError(f"{path}: unsupported quant type {type_name(t.ggml_type)} for tensor {t.name}")
        try:
            hf_target(arch, t.name)
        except ModelLoadError as err:
            raise ModelLoadError(f"{path}: {err}") from None


def _header(p: Path, reader: GGUFFile) -> GGUFCheckpoint:
    metadata = metadata_of(reader)
    try:
        arch = architecture_of(metadata)
        hf_config = hf_config_from_metadata(metadata, [t.name for t in reader.tensors])
    except ModelLoadError as err:
        raise ModelLoadError(f"{p}: {err}") from None
    _check_tensors(p, arch, reader)
    return GGUFCheckpoint(hf_config, {}, metadata, quant_type_counts(reader))


def read_gguf_header(path: str | Path) -> GGUFCheckpoint:
    """What `load_gguf` returns without its tensors (none is read): the HF config, metadata and
    quant types, for a model whose weights come from elsewhere (the weight cache)."""
    p = Path(path)
    return _header(p, open_gguf(p))


def load_gguf(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    progress: ProgressCallback | None = None,
    device: torch.device | str | None = None,
    keep_quantized: bool = False,
) -> GGUFCheckpoint:
    """Read the GGUF file at `path`: HF config, HF-named tensors in `dtype` on `device`, metadata
    and the count of tensors per quant type. With `keep_quantized`, matrices of an integer GGML
    type come back still in their blocks, decoded when packed (`RawGroupBlocks`; Q4_K / Q6_K as
    `RawSuperBlocks`; on the CPU) instead of being dequantized, and stacked
    expert tensors of an integer type or MXFP4 as lists of `Deferred` per-expert matrices
    (`expert_stack`)."""
    p = Path(path)
    reader = open_gguf(p)
    header = _header(p, reader)
    metadata, hf_config, arch = header.metadata, header.hf_config, architecture_of(header.metadata)
    assembler = HFTensorAssembler(
        arch,
        int(hf_config["num_attention_heads"]),  # type: ignore[arg-type]
        int(hf_config["num_key_value_heads"]),  # type: ignore[arg-type]
        dtype,
        linear_shape(hf_config),
    )
    total = len(reader.tensors)
    total_bytes = sum(t.n_bytes for t in reader.tensors)
    done_bytes = 0
    for i, t in enumerate(reader.tensors):
        try:
            data = reader.tensor_data(t)
            expert = expert_stack_name(t.name, arch) if keep_quantized and t.ggml_type in EXPERT_TYPES else None
            rows = keep_quantized and len(t.shape) == 2
            if expert is not None and len(t.shape) == 3:
                assembler.tensors[expert] = expert_stack(data, t.ggml_type, t.shape, t.name)
            elif rows and t.ggml_type in SUPERBLOCK_TYPES:
                assembler.add_quantized(t.name, superblock_rows(data, t.ggml_type, t.shape, t.name))
            elif rows and t.ggml_type in INTEGER_TYPES:
                assembler.add_quantized(t.name, group_rows(data, t.ggml_type, t.shape, t.name))
            else:
                wanted = torch.float32 if assembler.keeps_float32(t.name) else decode_dtype(t, dtype)
                assembler.add(t.name, dequantize(data, t.ggml_type, t.shape, t.name, wanted, device))
        except ModelLoadError as err:
            raise ModelLoadError(f"{p}: {err}") from None
        done_bytes += t.n_bytes
        if progress is not None:
            progress(i + 1, total, done_bytes, total_bytes)
    try:
        tensors = assembler.finish()
    except ModelLoadError as err:
        raise ModelLoadError(f"{p}: {err}") from None
    return GGUFCheckpoint(hf_config, tensors, metadata, header.quant_types)
