"""What each tensor-parallel rank built, reported to rank 0 once at start, and rank 0's check of it.

Owns the start-up exchange (one `all_gather_object` on the group, after the K/V tensors are
allocated, before the first step): each rank's weight plan (matrix -> the format it runs as,
`models.formats`) and its K/V bytes and storage dtype. Rank 0 refuses to serve, with one line,
when a rank's plan differs from its own (that rank's shard would compute another model: a slice
packed at another width, a matrix left float) or when a rank holds other K/V bytes than rank 0
(every rank holds the same KV heads' worth of pages in the same cache dtype; Gemma 3's one KV
head is replicated). It runs no step and starts no process.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from freetoken.errors import ConfigError
from freetoken.models.formats import first_difference, summary


@dataclass(frozen=True)
class RankReport:
    rank: int
    formats: dict[str, str]  # matrix -> what it runs as (models.formats.weight_formats)
    kv_bytes: int  # bytes of this rank's K/V pool tensors
    kv_dtype: str  # what the K/V pages hold

    def line(self) -> str:
        return f"rank {self.rank}: weights {summary(self.formats)}; K/V {self.kv_bytes} bytes of {self.kv_dtype}"


def exchange(report: RankReport) -> list[RankReport]:
    """Every rank's report, in rank order (a collective: every rank calls it once, at the same point)."""
    reports: list[RankReport | None] = [None] * dist.get_world_size()
    dist.all_gather_object(reports, report)
    return [r for r in reports if r is not None]


def check_reports(reports: list[RankReport]) -> None:
    """Raise ConfigError (one line) unless every rank's weight plan and K/V bytes are rank 0's."""
    first = reports[0]
    for other in reports[1:]:
        diff = first_difference(first.formats, other.formats)
        if diff is not None:
            raise ConfigError(
                f"tensor-parallel rank {other.rank} runs its weights differently from rank 0 ({diff}, rank 0 vs rank "
                f"{other.rank}): the ranks would compute different models"
            )
        if (other.kv_bytes, other.kv_dtype) != (first.kv_bytes, first.kv_dtype):
            raise ConfigError(
                f"tensor-parallel rank {other.rank} holds {other.kv_bytes} bytes of {other.kv_dtype} K/V where rank 0 "
                f"holds {first.kv_bytes} bytes of {first.kv_dtype}: the ranks would store different K/V"
            )
