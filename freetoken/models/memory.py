"""What a model holds in memory: estimated from the checkpoint's headers before loading, and
counted on the loaded model.

Owns two numbers the engine's start-up reports and checks (engine/build.py): `estimate_weights`
(bytes the weights will take under a `--weights` / `--prefill-weights` policy, from the tensor
inventory alone, so a configuration that cannot fit is refused before anything is read) and
`weight_bytes` (what a loaded model does hold: packed matrices, prefill copies, float tensors,
resident experts). It does not size the KV pools or decide anything.

The estimate's rules, per matrix (2-D tensor; 1-D ones are kept as float32):
- `auto` keeps Q4_K / Q6_K in their own integers, in the kernel's layout (0.578 and 0.828 bytes per
  weight against the file's 0.5625 and 0.820), other integer types in the group-32 form (the
  integers at 4, 5 or 8 bits, a 16-bit scale per 32 and a 16-bit minimum where the type has one:
  Q4_0 0.5625 bytes a weight, Q4_1 0.625, Q5_0 0.6875, Q5_1 1.125, Q8_0 1.0625), float ones in the
  model dtype; experts as other matrices (Q4_K / Q6_K in their own integers) and never copied;
- `--prefill-weights auto` adds a model-dtype copy of every matrix that is not Q4_K (the LM head
  and the token table aside) when the model dtype is 16-bit (none in float32), `bf16` of every
  quantized one but the token table;
  a fused projection (Q/K/V, gate/up) keeps one copy if any of its parts needs one;
- `bf16` is every matrix in the model dtype; `int8` 1.125 bytes a weight (0.75 where the file's
  integers fit 5 bits), `int4` 0.625.
Measured against `weight_bytes` under auto/auto, auto/quantized and int8: within 5% on the
Gemma 3 270M and SmolLM2 files (tests/model/test_memory_estimate.py), on the 1.1B Q4_K_M and on
the Qwen3-MoE-shaped Q4_K_M (benchmarks/make_model.py; docs/engineering/benchmarks.md).
"""

from __future__ import annotations

import torch
from torch import nn

from freetoken.models.experts import Experts, matrix_nbytes
from freetoken.models.linear import QuantizableWeight
from freetoken.weights.inventory import TensorEntry

# Bytes per weight as held, by GGUF storage type, under `--weights auto`.
# Group-32 forms: the packed integers, a 16-bit scale per 32 weights and a 16-bit minimum where the
# type has one.
_AUTO_BYTES = {
    "Q4_K": 0.578,
    "Q6_K": 0.828,
    "Q4_0": 0.5625,
    "Q4_1": 0.625,
    "Q5_0": 0.6875,
    "Q5_1": 1.125,
    "Q8_0": 1.0625,
    "MXFP4": 1.0625,
}
_NARROW = {"Q4_K", "Q4_0", "Q4_1", "Q5_0"}
# Experts never get a prefill copy; they are held as other matrices are (models/experts.py packs
# them with ops.qlinear.pack: Q4_K / Q6_K in their own integers where the kernel takes them).
EXPERT_TAGS = ("_exps", ".experts.")  # GGUF / Hugging Face names of expert tensors
_FLOAT_STORAGE = {"F32", "F16", "BF16", "F64"}
# The token table (GGUF, then Hugging Face names) is an embedding: never a prefill copy. The LM
# head gets one only under `--prefill-weights bf16`.
_TABLE = ("token_embd.", "embed_tokens.")
_HEAD = ("output.", "lm_head.")


def _is_float(storage: str) -> bool:
    return storage.upper() in _FLOAT_STORAGE


# Parts the model fuses into one projection (GGUF names, then Hugging Face ones): one part that
# needs a prefill copy gives the whole fused matrix one.
_FUSED = {
    "attn_q": "qkv",
    "attn_k": "qkv",
    "attn_v": "qkv",
    "q_proj": "qkv",
    "k_proj": "qkv",
    "v_proj": "qkv",
    "ffn_gate": "gate_up",
    "ffn_up": "gate_up",
    "gate_proj": "gate_up",
    "up_proj": "gate_up",
}


def _fused_group(name: str) -> str:
    """`blk.3.attn_q.weight` -> `blk.3.qkv`; a tensor outside a fused projection -> its name."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part in _FUSED:
            return ".".join([*parts[:i], _FUSED[part]])
    return name


def _per_weight(storage: str, weights: str, expert: bool) -> float:
    """Bytes per weight a quantized matrix of `storage` is held in under `weights`."""
    storage = storage.upper()
    if weights == "auto":
        return _AUTO_BYTES.get(storage, 1.125)
    if weights == "int8":  # 4- and 5-bit integers widen to 8 and are packed as 5 bits
        return 0.75 if storage in _NARROW else 1.125
    return 0.625


def _needs_copy(e: TensorEntry, prefill_weights: str, size: int) -> bool:
    """Whether `e` gets a prefill copy of `size` bytes a weight (models.linear.keeps_dense_copy)."""
    name = e.name.removeprefix("model.")
    if prefill_weights == "quantized" or name.startswith(_TABLE):
        return False
    if prefill_weights == "bf16":
        return True
    return size == 2 and e.storage.upper() != "Q4_K" and not name.startswith(_HEAD)


def estimate_weights(entries: list[TensorEntry], weights: str, prefill_weights: str, dtype: torch.dtype) -> int:
    """Bytes the weights listed in `entries` will take once loaded (module docstring's rules)."""
    size = torch.finfo(dtype).bits // 8
    total = 0.0
    copied: set[str] = set()
    quantized: list[TensorEntry] = []
    for e in entries:
        if len(e.shape) < 2:
            total += 4 * e.n_elements
        elif weights == "bf16" or _is_float(e.storage):
            total += size * e.n_elements  # float: held in the model dtype (auto keeps a float file float)
        else:
            expert = any(tag in e.name for tag in EXPERT_TAGS)
            total += _per_weight(e.storage, weights, expert) * e.n_elements
            quantized.append(e)
            if not expert and _needs_copy(e, prefill_weights, size):
                copied.add(_fused_group(e.name))
    total += sum(size * e.n_elements for e in quantized if _fused_group(e.name) in copied)
    return int(total)


def weight_bytes(model: nn.Module) -> dict[str, int]:
    """What `model` holds: `weights` (every packed matrix, float tensor and resident expert) and,
    within it, `prefill_copies` (the model-dtype copies kept for prefill)."""
    packed = copies = experts = 0
    for module in model.modules():
        if isinstance(module, QuantizableWeight) and module.packed is not None:
            packed += module.packed.nbytes
            if module.dense is not None:
                copies += module.dense.numel() * module.dense.element_size()
        elif isinstance(module, Experts):
            experts += sum(matrix_nbytes(m) for _, _, m in module.resident())
    floats = sum(t.numel() * t.element_size() for t in {t.data_ptr(): t for t in model.state_dict().values()}.values())
    return {"weights": packed + copies + experts + floats, "prefill_copies": copies}
