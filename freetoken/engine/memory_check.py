"""Start-up memory: refuse before loading a configuration that will not fit, and say after
loading what each part takes.

Owns `check_fits` (called before any weight is read: the weights' estimate from the checkpoint's
headers, models/memory.py, plus the K/V pools when `--num-tokens` fixes them, plus a workspace,
against the memory the machine has available; one line naming each part and what to change when
it does not fit) and `report_memory` (the log line after the pools are allocated: weights as held, of
them the prefill copies, K/V pools, the process's resident memory). It does not size the pools
(EngineConfig.resolve does, from what is left after loading) and does nothing on CUDA, where
the pools are sized from the device's free memory.
"""

from __future__ import annotations

import logging

import psutil
import torch

from freetoken.config import EngineConfig
from freetoken.errors import ConfigError
from freetoken.kv.tensors import KVTensors
from freetoken.models.memory import EXPERT_TAGS, estimate_weights, weight_bytes
from freetoken.models.registry import config_from_hf
from freetoken.weights.inventory import inventory
from freetoken.weights.loader import read_header, resolve_model

log = logging.getLogger("freetoken.engine")

MIB = 1 << 20
GIB = 1 << 30
# Resident memory of an engine process besides its weights and pools: torch and Python, oneDNN's
# primitives, a prefill chunk's activations. Measured: 390 MiB on the 1.1B at 1024-token chunks.
WORKSPACE = 512 * MIB


def _gib(n: int) -> str:
    return f"{n / GIB:.1f} GiB"


def check_fits(config: EngineConfig, dtype: torch.dtype, device: torch.device, available: int | None = None) -> None:
    """Raise ConfigError, before anything is loaded, when the weights (estimated), the K/V pools
    `--num-tokens` asks for and the workspace exceed `available` (default: the machine's
    available memory). With `--moe-strategy offload` the experts count as `--expert-cache-gb`."""
    if device.type != "cpu":
        return
    source = resolve_model(config.model)
    entries = inventory(source)
    experts = 0
    if config.moe_strategy == "offload":
        entries = [e for e in entries if not any(tag in e.name for tag in EXPERT_TAGS)]
        experts = int(config.expert_cache_gb * GIB)
    weights = estimate_weights(entries, config.weights, config.copies_for_prefill, dtype) + experts
    kv = 0
    if config.num_tokens is not None:
        model = config_from_hf(read_header(source).hf_config)
        layout = model.kv_layout()
        per_token = KVTensors.bytes_per_page(layout, 1, dtype, False, config.kv_cache_dtype, device)
        if model.has_swa:
            per_token += KVTensors.bytes_per_page(layout, 1, dtype, True, config.kv_cache_dtype, device) // 4
        kv = config.num_tokens * per_token
    need = weights + kv + WORKSPACE
    have = psutil.virtual_memory().available if available is None else available
    log.info(
        "memory plan: weights ~%s, K/V pools %s, workspace %s; %s available",
        _gib(weights),
        _gib(kv) if kv else "sized from what is left",
        _gib(WORKSPACE),
        _gib(have),
    )
    if need <= have:
        return
    hints = []
    if config.copies_for_prefill != "quantized":
        saved = weights - estimate_weights(entries, config.weights, "quantized", dtype) - experts
        if saved > 0:
            hints.append(f"--prefill-weights quantized (saves ~{_gib(saved)})")
    if kv:
        hints.append("a smaller --num-tokens")
    if config.weights in ("auto", "bf16", "int8"):
        hints.append("--weights int4")
    raise ConfigError(
        f"{source.name} needs about {_gib(need)} of memory (weights ~{_gib(weights)} under --weights {config.weights} "
        f"--prefill-weights {config.prefill_weights}, K/V {_gib(kv)}, workspace {_gib(WORKSPACE)}) and this machine has "
        f"{_gib(have)} available" + (f"; try {', or '.join(hints)}" if hints else "")
    )


def report_memory(model: torch.nn.Module, kv_bytes: int) -> None:
    """Log what each part takes, once the pools are allocated."""
    held = weight_bytes(model)
    rss = psutil.Process().memory_info().rss
    log.info(
        "memory: weights %d MiB (of which prefill copies %d MiB), K/V pools %d MiB; process resident %d MiB, "
        "%d MiB left available",
        held["weights"] // MIB,
        held["prefill_copies"] // MIB,
        kv_bytes // MIB,
        rss // MIB,
        psutil.virtual_memory().available // MIB,
    )
