"""CUDA graphs for decode steps: one captured forward per batch-size bucket, replayed over static
input buffers, with the eager forward as the fallback.

Owns choosing the bucket (the smallest of BUCKETS that holds the step's requests), the static
buffers a captured forward reads (token ids, positions, lengths, page tables, write slots, logit
rows: one set sized for the largest bucket, each bucket's batch a view of its first rows), filling
them for a step, capturing a bucket the first time it is used (and again only after `reset`, which
the runner calls when the K/V tensors are reallocated) and replaying it. A step is eligible when
every request decodes exactly one token with its logits (no prefill chunk, no drafted tokens) and
there are at most max(BUCKETS) of them; anything else, a bucket whose capture failed, and a model
or device the graphs do not serve (`decode_graphs_for`) run eagerly. A step of B requests in a
bucket of b > B fills rows B..b-1 with a copy of row 0 (same token, position, tables and write
slots): those rows compute row 0's K/V again and write it to row 0's slots, so no page but the
step's own is written and page 0 stays zero; their logits are dropped.

The capture itself (`CudaGraphOps`) is torch.cuda's; everything else is plain bookkeeping, which
tests check on CPU with a stand-in whose "replay" runs the forward again over the static buffers.
It does not schedule, sample or touch the KV manager, and the forward it captures is the runner's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np
import torch

from freetoken.attention.metadata import ForwardBatch, RequestSpec

log = logging.getLogger(__name__)

BUCKETS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)

Forward = Callable[[torch.Tensor, ForwardBatch], torch.Tensor]  # (input ids [T], batch) -> logits [N, vocab]


def bucket_for(n: int, buckets: Sequence[int] = BUCKETS) -> int | None:
    """The smallest bucket holding `n` requests; None when none does (the step runs eagerly)."""
    for b in buckets:
        if b >= n:
            return b
    return None


class GraphOps(Protocol):
    def capture(self, fn: Callable[[], torch.Tensor]) -> tuple[Any, torch.Tensor]:
        """Record `fn` (it may also run it); -> (graph, the output tensor a replay fills)."""

    def replay(self, graph: Any) -> None: ...


class CudaGraphOps:
    """torch.cuda's graphs: a warm-up run on a side stream (Triton compiles, allocators settle),
    then the capture into a memory pool shared by every bucket."""

    def __init__(self) -> None:
        self.pool: Any = None

    def capture(self, fn: Callable[[], torch.Tensor]) -> tuple[Any, torch.Tensor]:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()  # the step's own forward, eagerly: it writes this step's K/V, as the replays will again
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = fn()
        if self.pool is None:
            self.pool = graph.pool()
        return graph, out

    def replay(self, graph: Any) -> None:
        graph.replay()


class _Static:
    """The input buffers every bucket's graph reads, sized for the largest bucket."""

    def __init__(self, rows: int, width: int, has_swa: bool, device: torch.device) -> None:
        def zeros(*shape: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        self.ids = zeros(rows)
        self.positions = zeros(rows)
        self.kv_lens = zeros(rows)
        self.full_table = zeros(rows, width, dtype=torch.int32)
        self.full_slots = zeros(rows)
        self.swa_table = zeros(rows, width, dtype=torch.int32) if has_swa else None
        self.swa_slots = zeros(rows) if has_swa else None
        self.rows = torch.arange(rows, device=device)
        self.query_start = torch.arange(rows + 1, device=device)
        self.offsets = zeros(rows)


class DecodeGraphs:
    """Captured decode forwards by bucket over one set of static buffers (the module docstring)."""

    def __init__(
        self,
        forward: Forward,
        device: torch.device | str,
        page_size: int,
        width: int,
        has_swa: bool,
        sliding_window: int | None,
        buckets: Sequence[int] = BUCKETS,
        ops: GraphOps | None = None,
    ) -> None:
        self.forward = forward
        self.device = torch.device(device)
        self.page_size = page_size
        self.width = width  # page-table columns a graph reads: the context length in pages
        self.has_swa = has_swa
        self.sliding_window = sliding_window
        self.buckets = tuple(sorted(buckets))
        self.ops = ops if ops is not None else CudaGraphOps()
        self.static = _Static(self.buckets[-1], width, has_swa, self.device)
        self.graphs: dict[int, tuple[Any, torch.Tensor]] = {}  # bucket -> (graph, static logits [b, vocab])
        self.failed: set[int] = set()  # buckets whose capture raised: eager from then on
        self.replays = 0
        self.captures = 0

    def reset(self) -> None:
        """Forget every captured graph (the K/V tensors they read were reallocated)."""
        self.graphs.clear()
        self.failed.clear()

    def batch_of(self, b: int) -> ForwardBatch:
        """The ForwardBatch a bucket's graph runs: views of the first b rows of the static buffers."""
        s = self.static
        return ForwardBatch(
            page_size=self.page_size,
            positions=s.positions[:b],
            query_start=s.query_start[: b + 1],
            kv_lens=s.kv_lens[:b],
            full_table=s.full_table[:b],
            swa_table=None if s.swa_table is None else s.swa_table[:b],
            full_slots=s.full_slots[:b],
            swa_slots=None if s.swa_slots is None else s.swa_slots[:b],
            logits_indices=s.rows[:b],
            token_request=s.rows[:b],
            token_offset=s.offsets[:b],
            max_query_len=1,
            sliding_window=self.sliding_window if self.has_swa else None,
            swa_first_page=None,
            swa_num_pages=self.width,
        )

    def eligible(self, specs: Sequence[RequestSpec], logit_rows: Sequence[int]) -> int | None:
        """The bucket of a step that can replay a graph, or None (run it eagerly)."""
        n = len(specs)
        b = bucket_for(n, self.buckets)
        if b is None or b in self.failed or any(int(spec[1]) != 1 for spec in specs):
            return None
        if list(logit_rows) != list(range(n)):
            return None
        if any((int(spec[0]) + self.page_size) // self.page_size > self.width for spec in specs):
            return None
        return b

    def _fill(self, b: int, ids: Sequence[int], specs: Sequence[RequestSpec]) -> bool:
        """Write the step into the static buffers (rows past the step: row 0 again); False when a
        table maps a token to the NULL page (the eager path raises on it)."""
        n, P = len(specs), self.page_size
        order = list(range(n)) + [0] * (b - n)
        pos = np.array([int(specs[i][0]) for i in order], dtype=np.int64)
        col = pos // P

        def table(k: int) -> tuple[np.ndarray, np.ndarray] | None:
            rows = np.zeros((b, self.width), dtype=np.int32)
            for r, i in enumerate(order):
                t = np.asarray(specs[i][k], dtype=np.int32).reshape(-1)[: col[r] + 1]
                rows[r, : t.shape[0]] = t
            pages = rows[np.arange(b), col].astype(np.int64)
            if (pages == 0).any():
                return None
            return rows, pages * P + pos % P

        full = table(2)
        swa = table(3) if self.has_swa else None
        if full is None or (self.has_swa and swa is None):
            return False
        s = self.static

        def put(dst: torch.Tensor, src: np.ndarray) -> None:
            dst[:b].copy_(torch.from_numpy(src), non_blocking=True)

        put(s.ids, np.array([ids[i] for i in order], dtype=np.int64))
        put(s.positions, pos)
        put(s.kv_lens, pos + 1)
        put(s.full_table, full[0])
        put(s.full_slots, full[1])
        if swa is not None:
            put(s.swa_table, swa[0])  # type: ignore[arg-type]
            put(s.swa_slots, swa[1])  # type: ignore[arg-type]
        return True

    def run(self, ids: Sequence[int], specs: Sequence[RequestSpec], logit_rows: Sequence[int]) -> torch.Tensor | None:
        """Logits [B, vocab] of a decode step by graph replay, or None: the caller runs it eagerly."""
        b = self.eligible(specs, logit_rows)
        if b is None or not self._fill(b, ids, specs):
            return None
        n = len(specs)
        captured = self.graphs.get(b)
        if captured is None:
            batch = self.batch_of(b)

            def step() -> torch.Tensor:
                batch.memo.clear()  # plans from an earlier run would name other tensors
                return self.forward(self.static.ids[:b], batch)

            try:
                self.graphs[b] = self.ops.capture(step)
            except Exception as err:  # noqa: BLE001 - a forward that cannot be captured runs eagerly
                log.warning("CUDA graph capture of decode bucket %d failed (%s); that bucket runs eagerly", b, err)
                self.failed.add(b)
                return None
            self.captures += 1
            captured = self.graphs[b]
        graph, out = captured
        self.ops.replay(graph)
        self.replays += 1
        return out[:n]


def decode_graphs_for(
    enabled: bool,
    model: torch.nn.Module,
    kv_tensors: Any,
    page_size: int,
    context_length: int,
    has_swa: bool,
    sliding_window: int | None,
    has_linear: bool,
    tensor_parallel: bool,
) -> DecodeGraphs | None:
    """The decode graphs of an engine, or None where steps run eagerly: graphs off, a device other
    than CUDA, tensor parallelism (the followers run eagerly), a hybrid model (its recurrent state
    would be updated twice by a padding row), or no Triton decode attention (the SDPA backend plans
    from host values)."""
    from freetoken.attention import triton_fn

    if not enabled or kv_tensors.device.type != "cuda" or tensor_parallel or has_linear or triton_fn() is None:
        return None
    width = -(-context_length // page_size)

    def forward(ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        return model(ids, batch, kv_tensors)

    return DecodeGraphs(forward, kv_tensors.device, page_size, width, has_swa, sliding_window)
