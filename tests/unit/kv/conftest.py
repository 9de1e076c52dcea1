"""Hypothesis profile for the KV tests, and the KV event summary printed after the run.

The profile has no deadline (every KV call is followed by the shadow check and the audit, slow
on a shared CPU) and is never derandomized: each run, CI included, explores new programs, and a
failure prints the blob that reproduces it (`@reproduce_failure`). The fixed part of the
coverage is the seed set in test_kv_programs.py, not a replayed Hypothesis database.
"""

from __future__ import annotations

import os
from collections import Counter

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "freetoken-kv",
    deadline=None,
    derandomize=False,
    print_blob=True,
    database=None if os.environ.get("CI") else settings.default.database,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)

EVENTS = pytest.StashKey[Counter]()


@pytest.fixture(scope="session")
def kv_events(request: pytest.FixtureRequest) -> Counter:
    """Counts of KV events seen by the program tests, printed in the terminal summary."""
    return request.config.stash.setdefault(EVENTS, Counter())


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:  # type: ignore[no-untyped-def]
    events = config.stash.get(EVENTS, None)
    if events:
        terminalreporter.section("KV events (engine over a null model, shadow-checked)")
        for name, n in sorted(events.items()):
            terminalreporter.write_line(f"{n:8d}  {name}")
