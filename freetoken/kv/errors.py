"""Errors of the KV memory core.

Owns `KVIntegrityError`, raised when a checked page transfer or an audit finds that the reference
counts no longer describe who owns which page. It is an internal invariant violation, not a user
error: the engine catches it at the step boundary, logs the report, quarantines the pages named
and keeps serving (fatal under `--debug-kv`). This module must not import anything from the
engine or the server.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class IntegrityReport:
    """What went wrong, on which page, and who holds it."""

    check: str  # "alloc", "incref", "decref", "unique", "A1".."A6", "tree"
    pool: str  # "full", "swa" or "state" (a hybrid model's state slots)
    page: int
    refcount: int
    holders: tuple[str, ...] = field(default_factory=tuple)
    message: str = ""

    def __str__(self) -> str:
        who = ", ".join(self.holders) if self.holders else "no holder"
        return f"[{self.check}] {self.pool} page {self.page} rc={self.refcount} holders=[{who}]: {self.message}"


class KVIntegrityError(Exception):
    """A page transfer or audit found the KV ownership inconsistent.

    `reports` names every page involved with its reference count and all its holders.
    """

    def __init__(self, reports: list[IntegrityReport] | IntegrityReport) -> None:
        self.reports: list[IntegrityReport] = [reports] if isinstance(reports, IntegrityReport) else list(reports)
        super().__init__("; ".join(str(r) for r in self.reports))

    @property
    def report(self) -> IntegrityReport:
        """The first (usually the only) report."""
        return self.reports[0]

    def pages(self) -> dict[str, set[int]]:
        """Pages named by the reports, per pool: what the engine quarantines."""
        out: dict[str, set[int]] = {}
        for r in self.reports:
            if r.page > 0:
                out.setdefault(r.pool, set()).add(r.page)
        return out
