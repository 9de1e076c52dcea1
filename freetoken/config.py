"""Engine configuration: one frozen dataclass built from flags, and its resolution.

Owns the flags' defaults and the arithmetic that turns them into pool sizes once the model is
known (`EngineConfig.resolve` returns a new frozen `ResolvedConfig`). It never reads the
environment and holds no state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from freetoken.errors import ConfigError

CACHE_TYPES = ("naive", "radix", "swa_radix")
# The --weights policies (kept here, below models, so validation needs no model import).
WEIGHT_POLICIES = ("auto", "bf16", "int8", "int4")
PREFILL_WEIGHTS = ("auto", "bf16", "quantized")  # models.linear.keeps_dense_copy
MOE_STRATEGIES = ("resident", "offload")  # --moe-strategy (models/experts.py)
KV_CACHE_DTYPES = ("auto", "bf16", "int8", "q8_0", "fp8_e4m3")  # kv/tensors.py stores them (q8_0 = int8)
KV_DISK_LOADS = ("auto", "always")  # --kv-disk-load (kv/disk_cost.py)


def swa_floor_pages(max_running: int, max_prefill: int, window: int, page_size: int) -> int:
    """Smallest SWA pool (pages) that can always serve: each running request's window plus the
    page it is writing, and one prefill chunk (DESIGN.md §3, "SWA floor")."""
    per_request = math.ceil((window - 1) / page_size) + 1
    return max_running * per_request + math.ceil(max_prefill / page_size) + 1


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine is told. `None` means "derive it" in `resolve`."""

    model: str | None = None
    dtype: str = "auto"
    weights: str = "auto"  # auto | bf16 | int8 | int4 (models.linear.apply_policy)
    prefill_weights: str = (
        "auto"  # bf16: quantized linear layers keep a dense copy for prefill; auto: where it pays; quantized: none
    )
    device: str | None = None
    cache_type: str = "radix"
    page_size: int = 16
    max_running_requests: int = 16
    max_waiting_requests: int = 256
    max_prefill_length: int = 1024
    num_tokens: int | None = None
    memory_ratio: float = 0.3
    context_length: int | None = None
    swa_full_tokens_ratio: float | None = None
    swa_pool_tokens: int | str | None = None  # N tokens or "floor"
    debug_kv: bool = False
    max_pinned_tokens: int | None = None  # retention pins' cap (kv/pins.py); None: a quarter of the FULL pool
    # Hybrid models (linear-attention layers): state slots the prefix cache may keep as snapshots
    # beyond the running requests' (None: sized from memory, engine/build.py), and a snapshot
    # point at least every this many prompt tokens (0: only boundaries, branch points, resend caps).
    state_snapshots: int | None = None
    state_snapshot_interval: int = 2048
    kv_cache_dtype: str = "auto"  # auto | bf16 | int8 (q8_0) | fp8_e4m3 (CUDA): kv/tensors.py
    threads: int | None = None
    tensor_parallel_size: int = 1  # engine processes, one per rank (freetoken.distributed)
    speculative: str = "off"  # off | ngram: draft from the prompt and output (engine/speculative.py)
    spec_max_draft: int = 16  # drafted tokens per verified chunk at most (the window starts here)
    spec_ngram_min: int = 2  # n-gram sizes looked up, longest first
    spec_ngram_max: int = 4
    # Every row computed alike whether it is prefilled, decoded or verified, alone or batched,
    # cached or not: quantized kernels for every row count, attention query by query (docs/engine.md).
    deterministic: bool = False
    # Decode steps replay CUDA graphs captured per batch-size bucket (engine/cuda_graphs.py); CUDA only.
    cuda_graphs: bool = True
    weights_cache: str = "auto"  # auto | off | a directory: what a load made of the checkpoint, mapped on the next start (weights/weight_cache.py)
    moe_strategy: str = (
        "resident"  # resident | offload: experts decoded at load, or an LRU cache over the file (docs/moe.md)
    )
    expert_cache_gb: float = 4.0  # offload: the expert cache's budget (resizable: POST /admin/cache/resize)
    kv_disk_dir: str | None = None  # the disk tier under the prefix cache (kv/disk_tier.py); None: off
    kv_disk_gb: float = 16.0  # its bound (least recently used pages are deleted past it)
    kv_disk_load: str = "auto"  # auto: load when reading is measured cheaper than prefilling; always
    test_hold: str | None = None  # a test hook, off by default: the hold file of engine/hold.py

    def validate(self) -> None:
        """Raise ConfigError on flags that cannot work, naming the flag."""
        if self.weights not in WEIGHT_POLICIES:
            raise ConfigError(f"--weights must be one of {', '.join(WEIGHT_POLICIES)}, got {self.weights!r}")
        if self.prefill_weights not in PREFILL_WEIGHTS:
            raise ConfigError(
                f"--prefill-weights must be one of {', '.join(PREFILL_WEIGHTS)}, got {self.prefill_weights!r}"
            )
        if self.tensor_parallel_size < 1:
            raise ConfigError(f"--tensor-parallel-size must be at least 1, got {self.tensor_parallel_size}")
        if self.threads is not None and self.threads < 1:
            raise ConfigError(f"--threads must be at least 1, got {self.threads}")
        if not self.weights_cache:
            raise ConfigError("--weights-cache must be auto, off or a directory, got ''")
        if self.moe_strategy not in MOE_STRATEGIES:
            raise ConfigError(f"--moe-strategy must be one of {', '.join(MOE_STRATEGIES)}, got {self.moe_strategy!r}")
        if self.expert_cache_gb < 0:
            raise ConfigError(f"--expert-cache-gb must be at least 0, got {self.expert_cache_gb}")
        if self.moe_strategy == "offload" and self.tensor_parallel_size > 1:
            raise ConfigError("--moe-strategy offload does not support --tensor-parallel-size above 1")
        if self.cache_type not in CACHE_TYPES:
            raise ConfigError(f"--cache-type must be one of {', '.join(CACHE_TYPES)}, got {self.cache_type!r}")
        positive = {
            "--page-size": self.page_size,
            "--max-running-requests": self.max_running_requests,
            "--max-prefill-length": self.max_prefill_length,
        }
        for flag, value in positive.items():
            if value < 1:
                raise ConfigError(f"{flag} must be at least 1, got {value}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(
                f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}"
            )
        if self.max_pinned_tokens is not None and self.max_pinned_tokens < 0:
            raise ConfigError(f"--max-pinned-tokens must be >= 0, got {self.max_pinned_tokens}")
        if self.state_snapshots is not None and self.state_snapshots < 0:
            raise ConfigError(f"--state-snapshots must be >= 0, got {self.state_snapshots}")
        if self.state_snapshot_interval < 0:
            raise ConfigError(f"--state-snapshot-interval must be >= 0, got {self.state_snapshot_interval}")
        if self.max_waiting_requests < 0:
            raise ConfigError(f"--max-waiting-requests must be >= 0, got {self.max_waiting_requests}")
        if self.num_tokens is not None and self.num_tokens < self.page_size:
            raise ConfigError(f"--num-tokens must be at least one page ({self.page_size}), got {self.num_tokens}")
        if not 0.0 < self.memory_ratio <= 0.95:
            raise ConfigError(f"--memory-ratio must be in (0, 0.95], got {self.memory_ratio}")
        if self.context_length is not None and self.context_length < 2:
            raise ConfigError(f"--context-length must be at least 2, got {self.context_length}")
        if self.swa_full_tokens_ratio is not None and self.swa_pool_tokens is not None:
            raise ConfigError("--swa-full-tokens-ratio and --swa-pool-tokens are mutually exclusive")
        if self.swa_full_tokens_ratio is not None and not 0.0 < self.swa_full_tokens_ratio <= 1.0:
            raise ConfigError(f"--swa-full-tokens-ratio must be in (0, 1], got {self.swa_full_tokens_ratio}")
        if self.speculative not in ("off", "ngram"):
            raise ConfigError(f"--speculative must be off or ngram, got {self.speculative!r}")
        if self.spec_max_draft < 1:
            raise ConfigError(f"--spec-max-draft must be at least 1, got {self.spec_max_draft}")
        if not 1 <= self.spec_ngram_min <= self.spec_ngram_max:
            raise ConfigError(
                f"--spec-ngram-min / --spec-ngram-max must satisfy 1 <= min <= max, got {self.spec_ngram_min} / {self.spec_ngram_max}"
            )
        if self.deterministic:
            self._check_deterministic()
        if self.kv_disk_dir is not None:
            self._check_disk()
        pool = self.swa_pool_tokens
        if pool is not None and pool != "floor" and not (isinstance(pool, int) and pool >= 1):
            raise ConfigError(f"--swa-pool-tokens must be a positive number of tokens or 'floor', got {pool!r}")

    def _check_disk(self) -> None:
        """What the disk tier (--kv-disk-dir) cannot work with, refused by name."""
        if not self.kv_disk_dir:
            raise ConfigError("--kv-disk-dir must be a directory, got ''")
        if not self.kv_disk_gb > 0:
            raise ConfigError(f"--kv-disk-gb must be above 0, got {self.kv_disk_gb}")
        if self.kv_disk_load not in KV_DISK_LOADS:
            raise ConfigError(f"--kv-disk-load must be one of {', '.join(KV_DISK_LOADS)}, got {self.kv_disk_load!r}")
        if self.cache_type == "naive":
            raise ConfigError("--kv-disk-dir is a tier under the prefix cache: it needs --cache-type radix")
        if self.tensor_parallel_size > 1:
            raise ConfigError("--kv-disk-dir does not support --tensor-parallel-size above 1 (each rank holds a shard)")

    def _check_deterministic(self) -> None:
        """What --deterministic cannot keep its promise with, refused by name."""
        if self.prefill_weights == "bf16":
            raise ConfigError(
                "--deterministic multiplies every row by the quantized kernels: --prefill-weights bf16 "
                "(a dense copy for prefill-sized batches) cannot be used with it"
            )
        if self.page_size % 16:
            raise ConfigError(
                f"--deterministic needs --page-size a multiple of 16 (the attention's float32 lanes "
                f"follow key positions), got {self.page_size}"
            )
        if self.kv_cache_dtype not in ("auto", "bf16"):
            raise ConfigError(
                f"--deterministic reads K/V in the compute dtype: --kv-cache-dtype {self.kv_cache_dtype} "
                "cannot be used with it"
            )
        if self.device is not None and self.device.startswith("cuda"):
            raise ConfigError("--deterministic runs on CPU only (its attention is the CPU decode kernel)")

    @property
    def copies_for_prefill(self) -> str:
        """The --prefill-weights policy the load applies: `quantized` (none) under --deterministic."""
        return "quantized" if self.deterministic else self.prefill_weights

    @property
    def alone_max(self) -> int:
        """Chunks of at most this many tokens are attended query by query, as decode rows are
        (`ForwardBatch.alone_max`): every chunk under --deterministic; a verified chunk of drafted
        tokens when speculating, so that speculation never changes a greedy output."""
        if self.deterministic:
            return 1 << 30
        return self.spec_max_draft + 1 if self.speculative != "off" else 1

    def resolve(
        self, *, model_context_length: int, window: int | None, kv_bytes_per_token: int, available_bytes: int
    ) -> ResolvedConfig:
        """Pool sizes and the context length for a model; refuses an SWA pool below its floor.

        `kv_bytes_per_token` is what one token costs across both pools' layers; the FULL pool
        default spends `memory_ratio` of `available_bytes` on it, capped at what
        `max_running_requests` full contexts need.
        """
        self.validate()
        context = min(self.context_length or model_context_length, model_context_length)
        p = self.page_size
        if self.num_tokens is not None:
            full_pages = self.num_tokens // p
        else:
            by_memory = int(available_bytes * self.memory_ratio) // max(kv_bytes_per_token, 1) // p
            by_need = self.max_running_requests * math.ceil(context / p)
            full_pages = max(1, min(by_memory, by_need))
        cache_type = self.cache_type
        if window is None:
            if cache_type == "swa_radix":
                raise ConfigError("--cache-type swa_radix needs a model with sliding-window layers; use radix")
            return ResolvedConfig(self, context, cache_type, full_pages, None, None)
        if cache_type == "radix":
            cache_type = "swa_radix"
        floor = swa_floor_pages(self.max_running_requests, self.max_prefill_length, window, p)
        if self.swa_pool_tokens == "floor":
            swa_pages = floor
        elif isinstance(self.swa_pool_tokens, int):
            swa_pages = self.swa_pool_tokens // p
        elif self.swa_full_tokens_ratio is not None:
            swa_pages = int(full_pages * self.swa_full_tokens_ratio)
        else:
            swa_pages = max(floor, full_pages // 4)
        if swa_pages < floor:
            raise ConfigError(
                f"the SWA pool ({swa_pages} pages of {p} tokens) is below its floor of {floor} pages "
                f"({floor * p} tokens) for --max-running-requests {self.max_running_requests}, "
                f"--max-prefill-length {self.max_prefill_length}, window {window}; raise "
                "--swa-pool-tokens / --swa-full-tokens-ratio (or use --swa-pool-tokens floor), "
                "or lower --max-running-requests / --max-prefill-length"
            )
        return ResolvedConfig(self, context, cache_type, full_pages, swa_pages, floor)


@dataclass(frozen=True)
class ResolvedConfig:
    """An EngineConfig with the model-dependent values filled in."""

    engine: EngineConfig
    context_length: int
    cache_type: str
    full_pages: int
    swa_pages: int | None
    swa_floor: int | None
