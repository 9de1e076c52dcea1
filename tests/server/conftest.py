"""Fixtures for server tests: tiny model directories, one shared `ft serve` over the tiny
sliding-window model (small pools, chunked prefill, --debug-kv, an API key, cache report, the
engine's test hold), and the guard that judges every test on every server it uses.

The guard: before a test, each `ServeProcess` among its fixtures records the engine's pid,
restart count and audit violations (`begin_test`); after a passing test it waits for idle and
asserts the same engine, no new violation and balanced pools (`assert_balanced_idle`), so the
test that restarts the engine or breaks the accounting fails itself, instead of the next test
silently starting from a re-marked server. A test that kills the engine on purpose is marked
`expects_engine_restart`: it answers for the restart (and must show the server back itself).
What no test answered for -- a change between two tests, in a fixture, after the last test --
fails the module (`_module_guard`, on the shared server) and the server's end (`serving`).
"""

from __future__ import annotations

import sys
from collections.abc import Generator, Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hold import EngineHold  # noqa: E402
from serving import ServeProcess, serving  # noqa: E402

API_KEY = "test-key-123"
SHARED_FLAGS = [
    "--page-size", "4", "--num-tokens", "4096", "--max-running-requests", "4", "--max-waiting-requests", "2",
    "--max-prefill-length", "12", "--enable-cache-report", "--debug-kv", "--dtype", "float32", "--threads", "1",
]
SHARED_SERVER = pytest.StashKey[ServeProcess]()
EXPECTS_RESTART = "expects_engine_restart"


@pytest.fixture(scope="session")
def tiny_gemma_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tiny_models import write_tiny_model

    return write_tiny_model("gemma3", tmp_path_factory.mktemp("serve_tiny_gemma") / "tiny-gemma")


@pytest.fixture(scope="session")
def tiny_gemma_4k_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Gemma with a 4096-token context: the soak and chaos scripts' long conversations."""
    from tiny_models import write_tiny_model

    return write_tiny_model("gemma3", tmp_path_factory.mktemp("tiny_gemma_4k") / "tiny-gemma", max_position_embeddings=4096)


@pytest.fixture(scope="session")
def shared_hold(tmp_path_factory: pytest.TempPathFactory) -> EngineHold:
    return EngineHold(tmp_path_factory.mktemp("shared_hold") / "hold")


@pytest.fixture(scope="session")
def server(
    tiny_gemma_dir: Path, shared_hold: EngineHold, tmp_path_factory: pytest.TempPathFactory, pytestconfig: pytest.Config
) -> Iterator[ServeProcess]:
    """One `ft serve` for the OpenAI-surface, seed, soak, disconnect and queue tests."""
    log = tmp_path_factory.mktemp("serve_logs") / "shared.log"
    with serving(str(tiny_gemma_dir), [*SHARED_FLAGS, *shared_hold.flags], log, api_key=API_KEY) as proc:
        pytestconfig.stash[SHARED_SERVER] = proc
        yield proc
        del pytestconfig.stash[SHARED_SERVER]


@pytest.fixture
def hold(server: ServeProcess, shared_hold: EngineHold) -> Iterator[EngineHold]:
    """The shared server's engine hold, released again after the test whatever it did."""
    shared_hold.release()
    yield shared_hold
    shared_hold.release()


def _servers(item: pytest.Item) -> list[ServeProcess]:
    funcargs = getattr(item, "funcargs", {})
    return [value for value in funcargs.values() if isinstance(value, ServeProcess)]


@pytest.fixture(autouse=True)
def _mark_servers(request: pytest.FixtureRequest) -> None:
    for name in request.fixturenames:
        if name == request.fixturename:
            continue
        value = request.getfixturevalue(name)
        if isinstance(value, ServeProcess):
            value.begin_test(request.node.nodeid)
            value.guarded = True


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, object, object]:
    """After the test body: the guard (see the module docstring). A failing test answers for
    what happened during it; its own failure is the report."""
    servers = _servers(item)
    try:
        result = yield
    except BaseException:
        for proc in servers:
            proc.account()
        raise
    expects_restart = item.get_closest_marker(EXPECTS_RESTART) is not None
    for proc in servers:
        if expects_restart:
            proc.account()
            continue
        try:
            proc.assert_balanced_idle()
        except AssertionError:
            proc.account()  # reported here, as this test's failure: not again at the module's end
            raise
    return result


@pytest.fixture(scope="module", autouse=True)
def _module_guard(pytestconfig: pytest.Config) -> Iterator[None]:
    """After each module: the shared server (if it runs) has nothing unaccounted."""
    yield
    proc = pytestconfig.stash.get(SHARED_SERVER, None)
    if proc is not None and proc.proc.poll() is None:
        proc.assert_accounted()
