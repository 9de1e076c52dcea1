"""The per-test server guard of tests/server/conftest.py, on a small suite of its own run by a real
pytest in a subprocess (its own shared server): a test that kills the engine fails itself, even
though its body passes; the same test marked `expects_engine_restart` passes; the test after it
starts clean and passes; and a restart between tests, in a fixture no test answers for, fails the
module. Nothing is timed: the kills are SIGKILLs and every wait is a hang guard."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

CONFTEST = f'''
import importlib.util, sys
sys.path.insert(0, {str(HERE)!r})
sys.path.insert(0, {str(HERE.parent)!r})
spec = importlib.util.spec_from_file_location("server_conftest_under_test", {str(HERE / "conftest.py")!r})
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
globals().update({{k: v for k, v in vars(module).items() if not k.startswith("__")}})
'''

TESTS = '''
import os, signal
import pytest

def kill_and_wait(server):
    before = server.cache_status()["engine"]
    os.kill(before["pid"], signal.SIGKILL)
    end = __import__("time").monotonic() + 240
    while __import__("time").monotonic() < end:
        try:
            h = __import__("httpx").get(server.base + "/health", timeout=30)
            if h.status_code == 200 and h.json()["pid"] != before["pid"]:
                return
        except Exception:
            pass
        __import__("time").sleep(0.2)
    raise AssertionError("no restart")

def test_a_kill(server):
    kill_and_wait(server)

@pytest.mark.expects_engine_restart
def test_a_marked_kill(server):
    kill_and_wait(server)

def test_after(server):
    assert server.cache_status()["engine"]["in_flight"] == 0

@pytest.fixture
def kills_in_teardown(server):
    yield
    kill_and_wait(server)

def test_z_fixture_kill(server, kills_in_teardown):
    pass
'''


def test_the_guard_fails_the_test_that_restarts_the_engine(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_guarded.py").write_text(TESTS)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-p", "no:randomly", "--rootdir", str(tmp_path),
         "-o", "markers=expects_engine_restart: kills the engine", str(tmp_path / "test_guarded.py")],
        cwd=HERE.parents[1], capture_output=True, text=True, timeout=1200,
    )
    out = done.stdout
    assert "test_guarded.py::test_a_kill FAILED" in out, out[-4000:]
    assert "the engine restarted during this test" in out, out[-4000:]
    assert "test_guarded.py::test_a_marked_kill PASSED" in out, out[-4000:]
    assert "test_guarded.py::test_after PASSED" in out, out[-4000:]
    # The teardown kill is no test's: the module's end says so.
    assert "test_guarded.py::test_z_fixture_kill ERROR" in out or "error" in out.splitlines()[-1], out[-4000:]
    assert "the engine restarted or failed an audit between tests" in out or "something after the last test" in out, out[-4000:]
    assert done.returncode == 1, out[-4000:]
