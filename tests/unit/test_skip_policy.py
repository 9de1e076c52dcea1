"""tests/skip_policy.py on a small suite of its own, run by a real pytest in a subprocess: a full
default run with only stated skips passes; a skip of an unstated kind, or more of a kind than
stated, fails it (and says why); a partial run (-k, a single file) is not judged."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]

CONFTEST = f'''
import sys
sys.path.insert(0, {str(TESTS)!r})
import pytest
from skip_policy import Category, SkipPolicy

KEY = pytest.StashKey[SkipPolicy]()
CATS = (Category("cuda", r"needs a CUDA device", 2, "no CUDA here"),)

def pytest_configure(config):
    config.stash[KEY] = SkipPolicy(CATS)

def pytest_sessionfinish(session):
    session.config.stash[KEY].sessionfinish(session)

def pytest_terminal_summary(terminalreporter):
    terminalreporter.config.stash[KEY].terminal_summary(terminalreporter)
'''


def suite(tmp_path: Path, *skips: str) -> Path:
    (tmp_path / "pyproject.toml").write_text('[tool.pytest.ini_options]\ntestpaths = ["t"]\n')
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "conftest.py").write_text(CONFTEST)
    body = "import pytest\n\ndef test_runs():\n    assert True\n"
    for i, reason in enumerate(skips):
        body += f"\ndef test_skip_{i}():\n    pytest.skip({reason!r})\n"
    (tmp_path / "t" / "test_it.py").write_text(body)
    return tmp_path


def run(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args], cwd=root,
                          capture_output=True, text=True, timeout=120)


def test_stated_skips_pass(tmp_path: Path) -> None:
    done = run(suite(tmp_path, "needs a CUDA device", "needs a CUDA device"))
    assert done.returncode == 0, done.stdout
    assert "cuda: 2" in done.stdout and "every skip is of a stated kind" in done.stdout


@pytest.mark.parametrize("skips", [("needs a CUDA device", "scipy is not installed"), ("needs a CUDA device",) * 3])
def test_an_unstated_skip_or_too_many_fail_the_full_run(tmp_path: Path, skips: tuple[str, ...]) -> None:
    done = run(suite(tmp_path, *skips))
    assert done.returncode == 1, done.stdout
    assert "SKIP POLICY FAILED" in done.stdout


@pytest.mark.parametrize("args", [("-k", "skip"), ("t/test_it.py",), ("t/test_it.py::test_skip_1",), ("-x",)])
def test_a_partial_run_is_not_judged(tmp_path: Path, args: tuple[str, ...]) -> None:
    done = run(suite(tmp_path, "needs a CUDA device", "scipy is not installed"), *args)
    assert done.returncode == 0, done.stdout
    assert "skips of the full default run" not in done.stdout


def test_the_whole_directory_is_a_full_run(tmp_path: Path) -> None:
    done = run(suite(tmp_path, "scipy is not installed"), "t")
    assert done.returncode == 1 and "SKIP POLICY FAILED" in done.stdout, done.stdout


def test_the_stated_categories_are_the_readmes() -> None:
    """README's Tests section states each category's count; the policy holds the same numbers."""
    from skip_policy import CATEGORIES

    readme = (TESTS.parent / "README.md").read_text()
    tests_section = readme[readme.index("## Tests"):]
    for cat in CATEGORIES:
        assert f"`{cat.name}` ({cat.most})" in tests_section, cat
    assert f"at most {sum(c.most for c in CATEGORIES)} skips" in tests_section
