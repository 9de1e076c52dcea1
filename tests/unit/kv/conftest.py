"""Hypothesis profile for the KV tests: no deadline (audits after every step are slow on a shared
CPU), derandomized when the CI environment variable is set so CI runs are reproducible."""

import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "freetoken-kv",
    deadline=None,
    derandomize=bool(os.environ.get("CI")),
    database=None if os.environ.get("CI") else settings.default.database,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
