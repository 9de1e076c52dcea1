"""The whole suite's own check: a full default run's skips are only of the kinds, and at most the
counts, that README's Tests section states (tests/skip_policy.py). Partial runs are not judged."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from skip_policy import SkipPolicy  # noqa: E402

POLICY = pytest.StashKey[SkipPolicy]()


def pytest_configure(config: pytest.Config) -> None:
    config.stash[POLICY] = SkipPolicy()


def pytest_sessionfinish(session: pytest.Session) -> None:
    session.config.stash[POLICY].sessionfinish(session)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    terminalreporter.config.stash[POLICY].terminal_summary(terminalreporter)
