"""A test hook: hold the engine at a point a test chooses, until the test lets it go.

`ft serve --test-hold PATH` (EngineConfig.test_hold; off by default, and nothing but tests sets
it). While PATH does not exist the engine runs as without the flag. While it exists, the file says
what is held, read afresh before every step:

- `decode N`: a running request that has N or more output tokens gets no decode row, so it stays
  in flight, holding its pages, until the file changes or it is aborted (prefill and requests
  with fewer tokens run on). Then every request in flight is held, the step schedules nothing,
  and the engine waits `IDLE_WAIT_S` before its next look, so a held engine does not spin.
- `step`: the next step that has work waits at its start (sleeping, so the GIL is free and the
  heartbeat thread beats on) until the file changes.

So a server test makes "a stream still running when X happens" or "a step longer than the hang
timeout" true by control rather than by the speed of the machine: it writes the file, waits for
the state it needs (read from /v1/cache/status or the log), acts, then removes the file (an
atomic rename is how it changes it). Anything else in the file is an error, raised at the step.
It owns no engine state and must not touch the KV cache.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from freetoken.request import Request

IDLE_WAIT_S = 0.01  # between looks while everything in flight is held or a step is held


@dataclass(frozen=True)
class HoldRule:
    """What the hold file says now: `decode_after` output tokens, or the whole step."""

    decode_after: int | None = None
    step: bool = False

    def holds(self, req: Request) -> bool:
        """True when `req`'s decode row must wait."""
        return self.decode_after is not None and len(req.output_ids) >= self.decode_after


def parse_rule(text: str) -> HoldRule:
    words = text.split()
    if words == ["step"]:
        return HoldRule(step=True)
    if len(words) == 2 and words[0] == "decode" and words[1].isdigit():
        return HoldRule(decode_after=int(words[1]))
    raise ValueError(f"test hold file: expected 'decode N' or 'step', got {text!r}")


class TestHold:
    """Reads the hold file; one instance per engine."""

    __test__ = False  # not a pytest test class, whatever its name

    def __init__(self, path: str) -> None:
        self.path = path

    def rule(self) -> HoldRule | None:
        """The rule in force now; None when the file is absent."""
        try:
            with open(self.path) as f:
                text = f.read()
        except FileNotFoundError:
            return None
        return parse_rule(text)

    def wait_while_step_held(self) -> None:
        """Block (GIL released) while the file says `step`."""
        while (rule := self.rule()) is not None and rule.step:
            time.sleep(IDLE_WAIT_S)

    def idle_wait(self) -> None:
        """The pause after a step in which every request in flight was held."""
        if os.path.exists(self.path):
            time.sleep(IDLE_WAIT_S)
