"""Refusing a tensor-parallel size that cannot work, before any rank starts.

Owns two checks, each a one-line ConfigError naming `--tensor-parallel-size`: more ranks than the
CPU cores (or CUDA devices) this process may use, and a world size that does not split the
model's attention and KV heads (read from config.json or the GGUF metadata, without torch, so
that `ft serve` refuses before it listens). The full check on the loaded config, MLP width
included, is `models.shard.check_shardable`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping

from freetoken.errors import ConfigError
from freetoken.weights.gguf_metadata import read_metadata
from freetoken.weights.source import resolve_model


def check_world_fits(world: int, cuda: bool, cuda_devices: int) -> None:
    """One rank per CUDA device, or at most one rank per CPU core this process may run on."""
    if cuda:
        if world > cuda_devices:
            raise ConfigError(
                f"--tensor-parallel-size {world} is more than the {cuda_devices} CUDA devices of this machine"
            )
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if world > cores:
        raise ConfigError(f"--tensor-parallel-size {world} is more than the {cores} CPU cores this process may use")


def _heads(spec: str | None) -> tuple[int, int]:
    """(attention heads, KV heads) of the checkpoint `spec` names."""
    source = resolve_model(spec)
    if source.kind == "gguf":
        meta: Mapping[str, object] = read_metadata(source.path)
        arch = str(meta.get("general.architecture"))
        heads = int(meta[f"{arch}.attention.head_count"])  # type: ignore[call-overload]
        return heads, int(meta.get(f"{arch}.attention.head_count_kv", heads))  # type: ignore[call-overload]
    config = json.loads((source.path / "config.json").read_text())
    config = config.get("text_config", config)
    heads = int(config["num_attention_heads"])
    return heads, int(config.get("num_key_value_heads", heads))


def check_model_heads(spec: str | None, world: int) -> None:
    """The model's heads split evenly over `world` ranks; its KV heads split, or replicate evenly."""
    if world == 1:
        return
    heads, kv_heads = _heads(spec)
    if heads % world:
        raise ConfigError(f"--tensor-parallel-size {world} does not divide the model's {heads} attention heads")
    if kv_heads % world and world % kv_heads:
        raise ConfigError(
            f"--tensor-parallel-size {world} neither divides nor is a multiple of the model's {kv_heads} KV heads"
        )
