"""The package stays in the formatter's layout (pyproject.toml's `[tool.ruff]`: 120 columns, calls
that fit joined on one line): code that `ruff format freetoken` would change fails here, named."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def check(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ruff", "format", "--check", str(path)], cwd=ROOT,
                          capture_output=True, text=True)


def test_the_package_is_formatted() -> None:
    out = check(ROOT / "freetoken")
    assert out.returncode == 0, f"run `ruff format freetoken`:\n{out.stdout}{out.stderr}"


def test_an_unformatted_file_is_caught(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("x = f( 1,2 )\n")
    assert check(bad).returncode != 0
