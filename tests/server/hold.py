"""Drive the engine's test hook (`ft serve --test-hold PATH`, freetoken/engine/hold.py) from a
server test: hold every request in flight after N output tokens, or hold the next step, until the
test releases it. Writes are atomic (a rename), so the engine never reads half a rule."""

from __future__ import annotations

import os
from pathlib import Path


class EngineHold:
    """The hold file of one server (or of several run one after another)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @property
    def flags(self) -> list[str]:
        return ["--test-hold", str(self.path)]

    def _write(self, rule: str) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(rule)
        os.replace(tmp, self.path)

    def decode_after(self, tokens: int) -> None:
        """From now on a request with `tokens` or more output tokens is held (stays in flight)."""
        self._write(f"decode {tokens}")

    def step(self) -> None:
        """The next step with work waits at its start until `release`."""
        self._write("step")

    def release(self) -> None:
        self.path.unlink(missing_ok=True)
