"""Loading a model for serving: checkpoint -> ModelConfig -> model with weights -> tokenizer.

Owns the one path every entry point (`ft generate`, `LLM`, the engine process) uses to turn
`--model` into a ready model and its tokenizer. The tokenizer is built on first use: the engine
process needs it only to compile a grammar, and a large vocabulary takes seconds to build (the
API process builds its own). It does not size KV memory or schedule anything.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from freetoken.errors import ModelLoadError
from freetoken.models import shard
from freetoken.models.bind import bind_submodules
from freetoken.models.config import ModelConfig
from freetoken.models.experts import offload_experts
from freetoken.models.experts_cache import GIB, ExpertCache
from freetoken.models.formats import summary, weight_formats
from freetoken.models.linear import check_policy
from freetoken.models.registry import build_model, config_from_hf
from freetoken.models.snapshot import SNAPSHOT_VERSION, capture, restore
from freetoken.ops.qlinear import signature
from freetoken.tokenizer import Tokenizer
from freetoken.tokenizer.cache import TokenizerCache
from freetoken.utils.disk_cache import cache_dir, code_identity
from freetoken.utils.heap import return_freed_memory
from freetoken.weights.gguf_metadata import forget_opened, open_gguf
from freetoken.weights.loader import (
    Checkpoint,
    ModelSource,
    checkpoint_files,
    load_checkpoint,
    read_header,
    resolve_model,
)
from freetoken.weights.progress import ProgressCallback
from freetoken.weights.source import file_identity
from freetoken.weights.weight_cache import WeightCache

log = logging.getLogger("freetoken.models")


@dataclass
class LoadedModel:
    source: ModelSource
    config: ModelConfig
    model: torch.nn.Module
    make_tokenizer: Callable[[], Tokenizer] = field(repr=False, compare=False)  # `tokenizer` is built by it, once
    dtype: torch.dtype
    device: torch.device
    quant_types: dict[str, int]
    weights: str = "bf16"  # the --weights policy the model was loaded with
    formats: dict[str, str] = field(default_factory=dict)  # matrix -> what it runs as (models.formats)
    from_cache: bool = False  # the weights were mapped from the weight cache, not read from the checkpoint
    # the weight cache's write of this load's snapshot, still running after the load returns (None: no write)
    cache_writer: threading.Thread | None = field(default=None, repr=False, compare=False)

    @functools.cached_property
    def tokenizer(self) -> Tokenizer:
        """The model's tokenizer, built on first use (Gemma 3's 262k-token vocabulary: ~3 s)."""
        return self.make_tokenizer()


def load_tokenizer(source: ModelSource, weights_cache: str | None = None) -> Tokenizer:
    """The tokenizer of `source`: from the GGUF's metadata (through the tokenizer cache under
    `weights_cache`, tokenizer/cache.py) or the model directory's tokenizer files."""
    if source.kind == "gguf":
        return Tokenizer.from_gguf_metadata(open_gguf(source.path).metadata, TokenizerCache.for_setting(weights_cache))
    return Tokenizer.from_pretrained_dir(source.path)


def _cache_key(source: ModelSource, dtype: torch.dtype, weights: str, prefill_weights: str) -> dict:
    """What decides a snapshot's content: the checkpoint's files, the code that packs them, the
    kernels this build has, torch's version and the load options."""
    return {
        "snapshot": SNAPSHOT_VERSION,
        "source": [file_identity(f) for f in checkpoint_files(source)],
        "code": _code(),
        "kernels": signature(),
        "torch": torch.__version__,
        "dtype": str(dtype),
        "weights": weights,
        "prefill_weights": prefill_weights,
    }


@functools.cache
def _code() -> str:
    package = Path(__file__).resolve().parents[1]
    return code_identity(package / sub for sub in ("ops", "weights", "families", "models"))


def _cache_for(weights_cache: str | None, device: torch.device, world: int, moe_strategy: str) -> WeightCache | None:
    """The weight cache a load may use: CPU, one rank, resident experts (docs/operations.md)."""
    directory = cache_dir(weights_cache)
    if directory is None or device.type != "cpu" or world > 1 or moe_strategy != "resident":
        return None
    return WeightCache(directory)


def _write_behind(cache: WeightCache, key: dict, model: torch.nn.Module) -> threading.Thread:
    """Write the model's snapshot on a thread of its own, so the engine is ready before the
    write ends (torch.save and the checksums free the GIL while they write and read). A daemon:
    the engine process waits for it at shutdown for a bounded time (`finish_cache_write`); a
    write cut short, like one in a killed process, leaves only a temporary file, which a later
    write deletes."""
    snapshot = capture(model)

    def write() -> None:
        t0 = time.perf_counter()
        written = cache.write(key, snapshot)
        if written is not None:
            log.info("weight cache: wrote %s in %.1f s", written, time.perf_counter() - t0)

    thread = threading.Thread(target=write, name="weight-cache-write", daemon=True)
    thread.start()
    return thread


def finish_cache_write(loaded: LoadedModel, timeout_s: float) -> bool:
    """Wait up to `timeout_s` for the load's weight-cache write (a server stopped right after it
    became ready still leaves the entry its next start maps). False when it is still running."""
    writer = loaded.cache_writer
    if writer is None or not writer.is_alive():
        return True
    log.info("finishing the weight cache write (up to %.0f s) before exiting", timeout_s)
    writer.join(timeout_s)
    if writer.is_alive():
        log.warning(
            "weight cache: the write did not finish in %.0f s; abandoned (the next start reads the checkpoint)",
            timeout_s,
        )
        return False
    return True


def _from_snapshot(
    source: ModelSource,
    cache: WeightCache,
    key: dict,
    dtype: torch.dtype,
    device: torch.device,
    progress: ProgressCallback | None = None,
) -> tuple[Checkpoint, ModelConfig, torch.nn.Module] | None:
    """The model built from the cached snapshot under `key`, or None (a miss, or a snapshot
    that does not fit: logged). `progress` as the entry's bytes are checked."""
    snapshot = cache.read(key, progress)
    if snapshot is None:
        return None
    header = read_header(source)
    config = config_from_hf(header.hf_config)
    model = build_model(config, dtype, device)
    try:
        restore(model, snapshot)
    except ModelLoadError as err:
        log.warning("weight cache entry for %s does not fit (%s): loading from the checkpoint", source.name, err)
        return None
    return header, config, model


def load_model(
    spec: str | None,
    dtype: torch.dtype,
    device: torch.device,
    weights: str = "bf16",
    prefill_weights: str = "quantized",
    rank: int = 0,
    world: int = 1,
    moe_strategy: str = "resident",
    expert_cache_gb: float = 0.0,
    weights_cache: str | None = None,
    progress: ProgressCallback | None = None,
) -> LoadedModel:
    """Resolve `spec`, read its weights, build the model on `device` with activations in `dtype`
    and each matrix as the `weights` policy says (`models.linear.apply_policy`; `bf16`, the
    default here, is every weight in `dtype`; the serving default is `auto`). `prefill_weights`
    says which quantized linear layers also keep a copy dequantized to `dtype` for prefill batches
    (`models.linear.keeps_dense_copy`: `bf16` all, `auto` where the kernel is slower, `quantized` none).
    With `world` > 1 the model is rank `rank`'s tensor-parallel shard (`models.shard`; the
    process group must be joined): `config` stays the whole model's, `model.config` is the shard's.
    `moe_strategy` `offload` leaves the experts in the checkpoint (the GGUF memory map) and decodes
    them on demand into an LRU cache of `expert_cache_gb` GiB (models/experts.py).
    `weights_cache` (`auto`, a directory, or `off` / None) is where what the load made of the
    checkpoint is kept and, on the next load with the same file, code and options, memory-mapped
    instead of read and packed again (weights/weight_cache.py; CPU, one rank, resident experts).
    `progress` is called after each tensor read from the checkpoint, or, from the weight cache,
    after each chunk of the entry checked (bytes only: weights/progress.py)."""
    check_policy(weights)
    t0 = time.perf_counter()
    source = resolve_model(spec)
    log.info("loading %s from %s", source.name, source.path)
    cache = _cache_for(weights_cache, device, world, moe_strategy)
    key = _cache_key(source, dtype, weights, prefill_weights) if cache is not None else {}
    cached = _from_snapshot(source, cache, key, dtype, device, progress) if cache is not None else None
    writer = None
    if cached is not None:
        ckpt, config, model = cached
        plan = None
        how = "from the weight cache"
    else:
        ckpt, config, model, plan = _from_checkpoint(
            source, dtype, device, weights, prefill_weights, rank, world, moe_strategy, expert_cache_gb, progress
        )
        how = "from the checkpoint"
        if cache is not None:
            writer = _write_behind(cache, key, model)
    if plan is not None:
        shard.install_collectives(model, plan)
    model.eval()
    bind_submodules(model)
    quant_types = ckpt.quant_types
    del ckpt  # the checkpoint's temporaries: freed, then returned to the system
    forget_opened()  # and the file's map with them (its pages would count as resident memory)
    return_freed_memory()
    formats = weight_formats(model)
    log.info(
        "loaded %s (%s, %s, weights %s) %s in %.1f s",
        source.name,
        config.architecture,
        dtype,
        weights,
        how,
        time.perf_counter() - t0,
    )
    log.info(
        "weights of rank %d of %d run as %s%s",
        rank,
        world,
        summary(formats),
        "" if plan is None else f" (block outputs: {plan.row_parallel})",
    )
    return LoadedModel(
        source,
        config,
        model,
        functools.partial(load_tokenizer, source, weights_cache),  # the file's metadata, read again if ever needed
        dtype,
        device,
        quant_types,
        weights,
        formats,
        cached is not None,
        writer,
    )


def _from_checkpoint(
    source: ModelSource,
    dtype: torch.dtype,
    device: torch.device,
    weights: str,
    prefill_weights: str,
    rank: int,
    world: int,
    moe_strategy: str,
    expert_cache_gb: float,
    progress: ProgressCallback | None = None,
) -> tuple[Checkpoint, ModelConfig, torch.nn.Module, shard.ShardPlan | None]:
    """Read the checkpoint and load its tensors into a new model (the shard's, under a plan)."""
    ckpt = load_checkpoint(source, dtype, keep_quantized=weights != "bf16", progress=progress)
    config = config_from_hf(ckpt.hf_config)
    tensors = ckpt.tensors
    plan = None
    if world > 1:
        plan = shard.ShardPlan(rank, world, config, shard.row_parallel_for(tensors, weights))
        shard.check_shardable(config, world, plan.row_parallel)
        tensors = shard.shard_tensors(tensors, plan)
    model = build_model(config if plan is None else plan.local_config(), dtype, device)
    if plan is not None:
        shard.gather_row_projections(model, plan)
        shard.split_experts(model, plan)
    if moe_strategy == "offload":
        offload_experts(model, ExpertCache(int(expert_cache_gb * GIB)))
    try:
        model.load_weights(tensors, weights, prefill_weights)
    except (KeyError, ValueError, RuntimeError) as err:
        raise ModelLoadError(f"{source.path}: weights do not fit the {config.architecture} model ({err})") from None
    return ckpt, config, model, plan
