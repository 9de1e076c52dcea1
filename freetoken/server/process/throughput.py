"""The engine process's periodic throughput and queue line: while requests are in flight, one
log line every `period_s` (10 s by default) with the queue (running, waiting) and what the last
period did (tokens generated and their rate, prompt tokens prefilled and their rate, prompt tokens
taken in, requests finished).

Owns `ThroughputLog`: it is handed the worker's running totals at every turn of its loop and
says when a line is due; the clock and the period are injected (tests drive it with a fake clock).
A period in which the engine was idle the whole time writes nothing, so an idle server's log
stays quiet. It imports no torch.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger("freetoken.engine")

DEFAULT_PERIOD_S = 10.0


@dataclass(frozen=True)
class Totals:
    """The worker's running totals since the process started."""

    generated: int = 0  # tokens generated
    prompt: int = 0  # prompt tokens of the requests added
    finished: int = 0  # requests finished
    prefilled: int = 0  # prompt tokens the engine computed (cache hits excluded)


class ThroughputLog:
    def __init__(
        self,
        period_s: float = DEFAULT_PERIOD_S,
        clock: Callable[[], float] = time.monotonic,
        emit: Callable[[str, dict[str, object]], None] | None = None,
    ) -> None:
        if period_s <= 0:
            raise ValueError(f"the throughput log's period must be positive, got {period_s}")
        self.period_s = period_s
        self.clock = clock
        self.emit = emit or (lambda text, fields: log.info(text, extra=fields))
        self._since: float | None = None  # when the current period began (None: idle, no period open)
        self._base = Totals()

    def observe(self, *, busy: bool, running: int, waiting: int, totals: Totals) -> str | None:
        """One turn of the worker's loop; returns the line when one was written."""
        now = self.clock()
        if self._since is None:
            if busy:  # work arrived: a period begins, counted from the last idle turn (the new prompts in it)
                self._since = now
            else:
                self._base = totals
            return None
        elapsed = now - self._since
        if elapsed < self.period_s:
            return None
        text, fields = self.line(running, waiting, totals, elapsed)
        self.emit(text, fields)
        self._since, self._base = (now, totals) if busy else (None, totals)
        return text

    def line(self, running: int, waiting: int, totals: Totals, elapsed: float) -> tuple[str, dict[str, object]]:
        generated = totals.generated - self._base.generated
        prompt = totals.prompt - self._base.prompt
        finished = totals.finished - self._base.finished
        prefilled = totals.prefilled - self._base.prefilled
        text = (
            f"busy: {running} running, {waiting} waiting; last {elapsed:.0f} s: {generated} tokens generated "
            f"({generated / elapsed:.1f} tok/s), {prefilled} prompt tokens prefilled ({prefilled / elapsed:.1f} tok/s), "
            f"{prompt} prompt tokens in, {finished} requests finished"
        )
        fields: dict[str, object] = {
            "event": "throughput",
            "running": running,
            "waiting": waiting,
            "period_s": round(elapsed, 3),
            "generated_tokens": generated,
            "generated_tokens_per_s": round(generated / elapsed, 2),
            "prompt_tokens": prompt,
            "prefilled_tokens": prefilled,
            "prefilled_tokens_per_s": round(prefilled / elapsed, 2),
            "requests_finished": finished,
        }
        return text, fields
