"""Building an engine from an EngineConfig: load the model, size the pools, wire the parts.

Owns start-up: dtype and device choice, torch threads, the memory check before loading and the
report after (engine/memory_check.py), pool sizing from memory (via
`EngineConfig.resolve`, which refuses an SWA pool below its floor) and allocating the K/V
tensors. Under `--tensor-parallel-size N` it also starts ranks 1..N-1 (`distributed.launch`)
before loading this rank's (rank 0's) shard, sends them the pool sizes and refuses to start when a
rank reports another weight plan or other K/V bytes (`distributed.report`). Nothing here runs per step.
"""

from __future__ import annotations

import logging

import psutil
import torch

from freetoken.config import EngineConfig, ResolvedConfig
from freetoken.distributed.checks import check_world_fits
from freetoken.distributed.group import rank_threads
from freetoken.distributed.launch import Peers, start_peers
from freetoken.distributed.report import RankReport, check_reports, exchange
from freetoken.engine.cuda_graphs import decode_graphs_for
from freetoken.engine.deterministic import prepare_deterministic
from freetoken.engine.engine import Engine
from freetoken.engine.grammar import GrammarCompiler
from freetoken.engine.memory_check import check_fits, report_memory
from freetoken.engine.resize import STATE_SLOTS_SPARE, state_floor
from freetoken.engine.runner import Runner
from freetoken.errors import ConfigError
from freetoken.kv.disk import GIB as DISK_GIB
from freetoken.kv.disk import DiskStore
from freetoken.kv.disk_cost import LoadPolicy
from freetoken.kv.disk_file import identity_key
from freetoken.kv.disk_tier import DiskTier
from freetoken.kv.manager import KVManager
from freetoken.kv.tensors import KVLayout, KVTensors
from freetoken.models.config import ModelConfig
from freetoken.models.experts_cache import GIB
from freetoken.models.load import LoadedModel, load_model
from freetoken.utils.hardware import default_device, resolve_dtype
from freetoken.weights.progress import ProgressCallback
from freetoken.weights.source import file_identity

log = logging.getLogger("freetoken.engine")


def available_bytes(config: EngineConfig, model_config: ModelConfig, device: torch.device) -> int:
    """Memory the K/V pools (and a hybrid model's state pool) may be sized from. An offload
    expert cache's budget is not available to them (it fills as experts are routed to)."""
    if device.type == "cuda":
        available = torch.cuda.mem_get_info(device)[0]
    else:
        available = psutil.virtual_memory().available
    if config.moe_strategy == "offload" and model_config.num_experts:  # the expert cache fills after this
        available = max(available - int(config.expert_cache_gb * GIB), 0)
    return available


def resolve_for_model(
    config: EngineConfig,
    model_config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    rank_layout: KVLayout | None = None,
    state_slots: int | None = None,
) -> ResolvedConfig:
    """Pool sizes for the model; `rank_layout` is one tensor-parallel rank's K/V shape (default:
    the whole model's). CPU ranks share one memory, so there every rank's K/V counts. A hybrid
    model's state pool (`state_slots`, default `state_pool_slots`) is allocated whole, before
    the pages."""
    layout = rank_layout or model_config.kv_layout()
    ranks_here = 1 if device.type == "cuda" else config.tensor_parallel_size
    cache = config.kv_cache_dtype
    full_bytes = ranks_here * KVTensors.bytes_per_page(layout, 1, dtype, False, cache, device)
    swa_bytes = (
        ranks_here * KVTensors.bytes_per_page(layout, 1, dtype, True, cache, device) if model_config.has_swa else 0
    )
    available = available_bytes(config, model_config, device)
    if model_config.has_linear:
        slot = layout.state_bytes()
        slots = state_pool_slots(config, slot, available) if state_slots is None else state_slots
        available = max(available - slots * slot, 0)
    return config.resolve(
        model_context_length=model_config.max_position_embeddings,
        window=model_config.sliding_window if model_config.has_swa else None,
        kv_bytes_per_token=full_bytes + swa_bytes // 4,
        available_bytes=available,
    )


SNAPSHOTS_PER_RUNNING = 4  # default snapshot slots per running request, at most ...
SNAPSHOT_MEMORY_SHARE = 0.1  # ... and within this share of the available memory ...
MIN_SNAPSHOTS = 4  # ... but never fewer (a shared system prompt and a few conversations' last turns)


def snapshot_slots(config: EngineConfig, slot_bytes: int, available: int) -> int:
    """State slots the prefix cache may keep as snapshots: `--state-snapshots`, or by default
    SNAPSHOTS_PER_RUNNING per running request within SNAPSHOT_MEMORY_SHARE of `available` (a
    Qwen3.5-35B-A3B slot is ~63 MB), at least MIN_SNAPSHOTS. With R running requests the default
    keeps, beside their own ends (2 each: kv/snapshots.py), the hit of each waiting request and
    both ends of a conversation between requests: ~3R conversations whose next requests queue at
    once, 2R whose next requests come later."""
    if config.state_snapshots is not None:
        return config.state_snapshots
    by_memory = int(SNAPSHOT_MEMORY_SHARE * available) // max(slot_bytes, 1)
    return max(MIN_SNAPSHOTS, min(SNAPSHOTS_PER_RUNNING * config.max_running_requests, by_memory))


def state_pool_slots(config: EngineConfig, slot_bytes: int, available: int) -> int:
    """Slots of a hybrid model's state pool: one per running request, STATE_SLOTS_SPARE, and
    the snapshots' (`snapshot_slots`)."""
    return state_floor(config.max_running_requests) + snapshot_slots(config, slot_bytes, available)


def refuse_unsupported_hybrid(config: EngineConfig, model_config: ModelConfig, device: torch.device) -> None:
    """What a hybrid model (linear-attention layers with a recurrent state) cannot run with yet,
    refused in one line naming the flag."""
    if not model_config.has_linear:
        return
    name = model_config.architecture
    if config.speculative != "off":
        raise ConfigError(
            f"--speculative {config.speculative} is not supported on {name} models yet: a verified chunk "
            "would advance the recurrent state past rejected drafts"
        )
    if config.deterministic:
        raise ConfigError(f"--deterministic is not supported on {name} models yet")
    if config.tensor_parallel_size > 1:
        raise ConfigError(f"--tensor-parallel-size {config.tensor_parallel_size} is not supported on {name} models")
    if device.type != "cpu":
        raise ConfigError(f"--device {device.type} is not supported on {name} models yet (tested on CPU only)")


def build_engine_for(config: EngineConfig, loaded: LoadedModel, peers: Peers | None = None) -> Engine:
    """An engine over an already loaded model (tests reuse one model across engines); `peers`:
    the other tensor-parallel ranks, told the pool sizes here and sent every step by the runner."""
    refuse_unsupported_hybrid(config, loaded.config, loaded.device)
    layout = loaded.model.config.kv_layout()  # this rank's KV heads: the model's own config (a shard's under TP)
    slots = None
    if loaded.config.has_linear:
        available = available_bytes(config, loaded.config, loaded.device)
        slots = state_pool_slots(config, layout.state_bytes(), available)
    resolved = resolve_for_model(config, loaded.config, loaded.dtype, loaded.device, layout, slots)
    window = loaded.config.sliding_window if loaded.config.has_swa else None
    kv = KVManager(
        full_pages=resolved.full_pages,
        swa_pages=resolved.swa_pages,
        page_size=config.page_size,
        window=window,
        cache_type=resolved.cache_type,
        max_pinned_pages=None if config.max_pinned_tokens is None else config.max_pinned_tokens // config.page_size,
        state_slots=slots,
        snapshot_interval=config.state_snapshot_interval,
    )
    tensors = KVTensors(
        layout,
        resolved.full_pages,
        resolved.swa_pages or 0,
        config.page_size,
        loaded.dtype,
        loaded.device,
        config.kv_cache_dtype,
        state_slots=slots or 0,
    )
    kv.bytes_per_token = {
        kind: KVTensors.bytes_per_page(layout, 1, loaded.dtype, kind == "swa", config.kv_cache_dtype, loaded.device)
        for kind in (("full", "swa") if loaded.config.has_swa else ("full",))
    }
    if slots:
        kv.copy_state = tensors.copy_state
        log.info(
            "state pool: %d slots of %.1f MB (%d running + %d spare + %d prefix-cache snapshots), %.2f GB",
            slots,
            layout.state_bytes() / 1e6,
            config.max_running_requests,
            STATE_SLOTS_SPARE,
            slots - config.max_running_requests - STATE_SLOTS_SPARE,
            slots * layout.state_bytes() / 1e9,
        )
    report_memory(loaded.model, tensors.nbytes)
    log.info(
        "KV pools: full %d pages, swa %s pages of %d tokens; cache %s; context %d",
        resolved.full_pages,
        resolved.swa_pages,
        config.page_size,
        resolved.cache_type,
        resolved.context_length,
    )
    if peers is not None:
        peers.sender.send_pools(resolved.full_pages, resolved.swa_pages or 0, config.page_size)
        reports = exchange(RankReport(0, loaded.formats, tensors.nbytes, str(tensors.dtype).removeprefix("torch.")))
        for report in reports:
            log.info("tensor parallelism, %s", report.line())
        check_reports(reports)  # a rank that built another model or other K/V: refused, one line
    prepare_deterministic(loaded.model, loaded.config, loaded.dtype, config.deterministic)
    graphs = decode_graphs_for(
        config.cuda_graphs,
        loaded.model,
        tensors,
        config.page_size,
        resolved.context_length,
        loaded.config.has_swa,
        window,
        loaded.config.has_linear,
        peers is not None,
    )
    runner = Runner(loaded.model, loaded.config, tensors, peers, alone_max=config.alone_max, graphs=graphs)
    disk = None if config.kv_disk_dir is None else disk_tier(config, loaded, tensors, window)
    return Engine(resolved, runner, kv, GrammarCompiler(lambda: loaded.tokenizer), disk)


def model_identity(loaded: LoadedModel) -> list[object]:
    """What makes this model's K/V what it is: its files (path, size, mtime), the weight policy and
    the format each matrix runs as, the compute dtype. A change of any invalidates the disk tier."""
    path = loaded.source.path
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.suffix in (".json", ".safetensors"))
    return [
        loaded.source.kind,
        [file_identity(f) for f in files],
        loaded.weights,
        sorted(loaded.formats.items()),
        str(loaded.dtype),
    ]


def disk_tier(config: EngineConfig, loaded: LoadedModel, tensors: KVTensors, window: int | None) -> DiskTier:
    """The disk tier under the prefix cache (--kv-disk-dir), its key the model's identity, the
    K/V storage dtype and shape, and the page size; it reads its index now."""
    layout = loaded.model.config.kv_layout()
    identity = identity_key([model_identity(loaded), str(tensors.dtype), repr(layout), config.page_size, window])
    try:
        store = DiskStore(config.kv_disk_dir, identity, int(config.kv_disk_gb * DISK_GIB))
    except OSError as err:
        raise ConfigError(f"--kv-disk-dir {config.kv_disk_dir} cannot be used: {err}") from None
    log.info("disk tier: %s, %d pages on disk (%.1f GiB bound)", store.dir, store.entries, config.kv_disk_gb)
    return DiskTier(store, tensors, config.page_size, window, LoadPolicy(config.kv_disk_load))


def load_for(config: EngineConfig, progress: ProgressCallback | None = None) -> LoadedModel:
    config.validate()
    if config.tensor_parallel_size > 1 and not torch.distributed.is_initialized():
        raise ConfigError("--tensor-parallel-size above 1 needs build_engine (ft serve), which starts the other ranks")
    threads = rank_threads(config)
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    device = torch.device(config.device) if config.device else default_device()
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device is available to this process")
    dtype = resolve_dtype(config.dtype, device)
    check_fits(config, dtype, device)  # before any weight is read: one line when it cannot fit
    return load_model(
        config.model,
        dtype,
        device,
        config.weights,
        config.copies_for_prefill,
        world=config.tensor_parallel_size,
        moe_strategy=config.moe_strategy,
        expert_cache_gb=config.expert_cache_gb,
        weights_cache=config.weights_cache,
        progress=progress,
    )


def build_engine(config: EngineConfig, progress: ProgressCallback | None = None) -> tuple[Engine, LoadedModel]:
    """The engine for `config`, its model loaded (`progress` after each tensor read; ft serve's loading bar)."""
    peers = None
    if config.tensor_parallel_size > 1:
        config.validate()
        device = torch.device(config.device) if config.device else default_device()
        check_world_fits(config.tensor_parallel_size, device.type == "cuda", torch.cuda.device_count())
        peers = start_peers(config, device)
    loaded = load_for(config, progress)
    return build_engine_for(config, loaded, peers), loaded
