"""Fixtures for server tests: tiny model directories and one shared `ft serve` over the tiny
sliding-window model (small pools, chunked prefill, --debug-kv, an API key, cache report), and
an autouse fixture that marks each test's start on every server it uses, so that a test's
integrity check counts only what happened during it."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from serving import ServeProcess, serving  # noqa: E402

API_KEY = "test-key-123"
SHARED_FLAGS = [
    "--page-size", "4", "--num-tokens", "4096", "--max-running-requests", "4", "--max-waiting-requests", "2",
    "--max-prefill-length", "12", "--enable-cache-report", "--debug-kv", "--dtype", "float32", "--threads", "1",
]


@pytest.fixture(scope="session")
def tiny_gemma_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tiny_models import write_tiny_model

    return write_tiny_model("gemma3", tmp_path_factory.mktemp("serve_tiny_gemma") / "tiny-gemma")


@pytest.fixture(scope="session")
def server(tiny_gemma_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    """One `ft serve` for the OpenAI-surface, seed, soak, disconnect and queue tests."""
    log = tmp_path_factory.mktemp("serve_logs") / "shared.log"
    with serving(str(tiny_gemma_dir), SHARED_FLAGS, log, api_key=API_KEY) as proc:
        yield proc


@pytest.fixture(autouse=True)
def _mark_servers(request: pytest.FixtureRequest) -> None:
    for name in request.fixturenames:
        if name == request.fixturename:
            continue
        value = request.getfixturevalue(name)
        if isinstance(value, ServeProcess):
            value.begin_test()
