"""Whether loading pages from the disk tier is cheaper than computing them again.

Owns the two measured rates the decision compares: the disk tier's read rate (bytes per second
of loads: read, checked and copied into the K/V memory) and the engine's prefill rate (prompt
tokens per second of forwards that computed prompt tokens). Both are running averages that
weigh recent observations more (a decay per observation), so a disk that slows down or a model
that prefills faster moves the decision. A load of `nbytes` covering `tokens` prompt tokens is
made when nbytes / read rate < tokens / prefill rate. Until both rates are measured a load is
made (the first load measures the read rate; on a CPU server reading a page is almost always
cheaper than recomputing it). `always` (`--kv-disk-load always`) skips the comparison. It does
no I/O and knows no pages.
"""

from __future__ import annotations

from freetoken.config import KV_DISK_LOADS as LOAD_MODES

DECAY = 0.8  # weight of the past at each new observation


class _Rate:
    """A decayed sum of (amount, seconds): amount per second, weighted toward recent samples."""

    def __init__(self) -> None:
        self.amount = 0.0
        self.seconds = 0.0

    def observe(self, amount: float, seconds: float) -> None:
        if amount <= 0 or seconds <= 0:
            return
        self.amount = self.amount * DECAY + amount
        self.seconds = self.seconds * DECAY + seconds

    @property
    def per_second(self) -> float | None:
        return self.amount / self.seconds if self.seconds > 0 else None


class LoadPolicy:
    """Decides each load from the measured read and prefill rates (or always loads)."""

    def __init__(self, mode: str = "auto") -> None:
        if mode not in LOAD_MODES:
            raise ValueError(f"--kv-disk-load must be one of {', '.join(LOAD_MODES)}, got {mode!r}")
        self.mode = mode
        self.read = _Rate()  # bytes per second
        self.prefill = _Rate()  # prompt tokens per second

    def observe_read(self, nbytes: int, seconds: float) -> None:
        self.read.observe(nbytes, seconds)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        self.prefill.observe(tokens, seconds)

    def should_load(self, nbytes: int, tokens: int) -> bool:
        """True when reading `nbytes` is expected to take less time than prefilling `tokens`."""
        if self.mode == "always":
            return True
        read, prefill = self.read.per_second, self.prefill.per_second
        if read is None or prefill is None:
            return True
        return nbytes / read < tokens / prefill

    def status(self) -> dict[str, object]:
        read, prefill = self.read.per_second, self.prefill.per_second
        return {
            "load_policy": self.mode,
            "read_bytes_per_s": None if read is None else round(read),
            "prefill_tokens_per_s": None if prefill is None else round(prefill, 1),
        }
