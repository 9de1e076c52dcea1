"""A loaded model's weights as one plain value, and back: what the weight cache stores.

Owns the walk over a model once its checkpoint is loaded — float parameters and persistent
buffers (the state dict), each quantizable layer's packed matrix and prefill copy, each layer's
resident experts — turning it into nested dicts and lists of tensors, numbers and strings
(`capture`, which copies nothing), and putting such a value back into a freshly built model of the
same configuration (`restore`, which takes the tensors as they are: memory-mapped ones stay
mapped, and nothing is repacked). It does not read or write files (weights/weight_cache.py) and
does not decide when a snapshot may be trusted (models/load.py keys it).
"""

from __future__ import annotations

import torch
from torch import nn

from freetoken.errors import ModelLoadError
from freetoken.models.experts import Experts, Matrix
from freetoken.models.linear import QuantizableWeight
from freetoken.ops.qlinear import from_state

# Bumped whenever what `capture` writes changes shape: an older snapshot is then a miss.
SNAPSHOT_VERSION = 5  # 2: experts in super-block form; 3: half last chunks (K % 512 == 256); 4: float32 routers;
# 5: a matrix whose columns move (Qwen3.5 out_proj in a GGUF) packed as stored (PackedColumns)


def _matrix(m: Matrix) -> object:
    return m if isinstance(m, torch.Tensor) else m.state()


def _unmatrix(v: object) -> Matrix:
    return from_state(v) if isinstance(v, dict) else v  # type: ignore[arg-type,return-value]


def capture(model: nn.Module) -> dict:
    """The model's loaded weights as plain values (references to its tensors, no copies).
    Raises ModelLoadError for a model whose experts are offloaded (their backing is the
    checkpoint's memory map, which a snapshot does not hold)."""
    layers: dict[str, dict] = {}
    experts: dict[str, dict] = {}
    for name, module in model.named_modules():
        if isinstance(module, QuantizableWeight) and module.packed is not None:
            layers[name] = {"packed": module.packed.state(), "dense": module.dense}
        elif isinstance(module, Experts):
            if module.cache is not None:
                raise ModelLoadError("offloaded experts are read from the checkpoint: no snapshot")
            experts[name] = {
                "gate_up": [_matrix(m) for m in module.gate_up],
                "down": [_matrix(m) for m in module.down],
                "gate_up_bias": module.gate_up_bias,
                "down_bias": module.down_bias,
            }
    return {"version": SNAPSHOT_VERSION, "state": model.state_dict(), "packed": layers, "experts": experts}


def _set_tensor(model: nn.Module, name: str, value: torch.Tensor) -> None:
    owner_name, _, leaf = name.rpartition(".")
    owner = model.get_submodule(owner_name)
    if leaf in owner._parameters:
        param = owner._parameters[leaf]
        if param is None or param.shape != value.shape or param.dtype != value.dtype:
            raise ModelLoadError(f"snapshot tensor {name} {tuple(value.shape)} {value.dtype} does not fit the model")
        param.data = value  # the snapshot's storage itself: no copy
    elif leaf in owner._buffers:
        owner._buffers[leaf] = value
    else:
        raise ModelLoadError(f"snapshot tensor {name} has no place in the model")


def restore(model: nn.Module, snapshot: dict) -> None:
    """Put `capture`'s value back into `model`, freshly built from the same configuration (and
    shard plan). Raises ModelLoadError when the snapshot does not fit the model (the caller then
    loads from the checkpoint) or is of another version."""
    if snapshot.get("version") != SNAPSHOT_VERSION:
        raise ModelLoadError(f"snapshot version {snapshot.get('version')!r}, expected {SNAPSHOT_VERSION}")
    modules = dict(model.named_modules())
    try:
        for name, entry in snapshot["packed"].items():
            layer = modules.get(name)
            if not isinstance(layer, QuantizableWeight):
                raise ModelLoadError(f"snapshot layer {name} is not a quantizable layer of the model")
            layer.restore_packed(from_state(entry["packed"]), entry["dense"])
        for name, entry in snapshot["experts"].items():
            experts = modules.get(name)
            if not isinstance(experts, Experts) or len(entry["gate_up"]) != experts.num_experts:
                raise ModelLoadError(f"snapshot experts {name} do not fit the model")
            experts.gate_up = [_unmatrix(m) for m in entry["gate_up"]]
            experts.down = [_unmatrix(m) for m in entry["down"]]
            experts.gate_up_bias, experts.down_bias = entry["gate_up_bias"], entry["down_bias"]
        expected = model.state_dict()
        if set(expected) != set(snapshot["state"]):
            missing = sorted(set(expected) ^ set(snapshot["state"]))[:5]
            raise ModelLoadError(f"snapshot tensors differ from the model's: {', '.join(missing)}")
        for name, value in snapshot["state"].items():
            _set_tensor(model, name, value)
    except (KeyError, TypeError, ValueError) as err:
        raise ModelLoadError(f"snapshot does not fit the model ({err})") from None
