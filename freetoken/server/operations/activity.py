"""What the dashboard shows that no other endpoint keeps: recent requests and tokens per second.

Owns `Activity`, held by the serving context: `Throughput` (prompt tokens computed and tokens
generated, summed into fixed time buckets as the API process sees them arrive, over the last
`span_s`) and `RecentRequests` (the last `size` finished requests: tokens, cache hit, TTFT,
latency, finish reason). Both are bounded (a deque each) and O(1) per update; neither talks to the
engine nor keeps anything per request in flight. Totals (requests served, cache hits, miss
reasons) stay the metrics' own (operations/metrics.py); `admin/activity.py` reads them there.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

BUCKET_S = 2.0
SPAN_S = 600.0  # ten minutes of history
RECENT = 50


class Throughput:
    """Tokens per `bucket_s` bucket: `add` counts into the bucket of now; `series` gives the last
    `span_s` of complete buckets, oldest first, as (prefill tok/s, decode tok/s), zeros included."""

    def __init__(
        self, bucket_s: float = BUCKET_S, span_s: float = SPAN_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.bucket_s = bucket_s
        self.size = max(1, int(span_s / bucket_s))
        self.clock = clock
        self._buckets: deque[list[int]] = deque(maxlen=self.size + 1)  # [bucket index, prefill, decode]

    def add(self, prefill: int = 0, decode: int = 0) -> None:
        index = int(self.clock() // self.bucket_s)
        if not self._buckets or self._buckets[-1][0] != index:
            self._buckets.append([index, 0, 0])
        bucket = self._buckets[-1]
        bucket[1] += prefill
        bucket[2] += decode

    def series(self) -> list[tuple[float, float]]:
        now = int(self.clock() // self.bucket_s)  # the bucket still filling is left out
        by_index = {b[0]: b for b in self._buckets}
        out = []
        for index in range(now - self.size, now):
            bucket = by_index.get(index)
            out.append((0.0, 0.0) if bucket is None else (bucket[1] / self.bucket_s, bucket[2] / self.bucket_s))
        return out


@dataclass(frozen=True)
class FinishedRequest:
    """One finished HTTP generation request, as the dashboard lists it."""

    at: float  # wall clock (epoch seconds) at its end
    endpoint: str
    status: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    ttft_s: float | None
    latency_s: float | None
    finish_reason: str | None  # the choices' reasons, distinct ones joined by ","
    miss_reason: str | None  # why the first prompt's prefix-cache hit stopped (kv/miss.py)


@dataclass
class Activity:
    throughput: Throughput = field(default_factory=Throughput)
    recent: deque[FinishedRequest] = field(default_factory=lambda: deque(maxlen=RECENT))

    def finished(self, request: FinishedRequest) -> None:
        self.recent.append(request)

    def document(self) -> dict[str, Any]:
        """The `throughput` and `recent` parts of `GET /admin/activity` (recent: newest first)."""
        return {
            "throughput": {"bucket_s": self.throughput.bucket_s, "series": [list(p) for p in self.throughput.series()]},
            "recent": [asdict(r) for r in reversed(self.recent)],
        }
