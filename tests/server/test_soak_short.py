"""`benchmarks/soak.py`, short: 12 requests of concurrent tool-calling conversations on the tiny
sliding-window model (--debug-kv, so every step is audited), then the soak's own verdict: no
request error, no violation, no restart, balanced pools at idle, RSS within its bound, and a
drained exit 0. Also checks that the CSV, JSON and plot it writes carry what they should.

No clock: `--requests` makes the run exactly 12 requests (4 turns of 3 conversations; each
conversation's first turn forces a tool call, its later turns extend its own prefix), with a
sample after each completed request before its conversation goes on, so there are at least
12 / 3 + 2 samples on any machine."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parents[2]


def test_short_soak_passes(tiny_gemma_4k_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "soak"
    cmd = [
        sys.executable, "benchmarks/soak.py", "--model", str(tiny_gemma_4k_dir), "--requests", "12", "--warmup", "3",
        "--conversations", "3", "--turns", "4", "--max-tokens", "90", "--system-sentences", "3", "--threads", "1",
        "--max-rss-growth-mb", "64", "--out", str(out),
        "--serve-arg=--dtype", "--serve-arg=float32", "--serve-arg=--page-size", "--serve-arg=4",
        "--serve-arg=--num-tokens", "--serve-arg=8192", "--serve-arg=--debug-kv",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((out / "soak.json").read_text())
    assert summary["passed"] and summary["errors"] == 0 and summary["serve_exit_code"] == 0, summary
    assert summary["requests"] == 12 and summary["tool_calls"] > 0 and summary["cached_tokens"] > 0, summary
    with open(out / "soak.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) >= 12 // 3 + 2, rows
    assert [int(r["requests"]) for r in rows] == sorted(int(r["requests"]) for r in rows) and rows[-1]["requests"] == "12"
    for column in ("rss_total_mb", "full_free", "full_cached", "full_in_use", "swa_in_use", "violations", "errors", "heartbeat_max_gap_s"):
        assert rows[-1][column] != "", column
    assert int(rows[-1]["full_in_use"]) == 0 and int(rows[-1]["violations"]) == 0
    import matplotlib  # noqa: F401 - declared in [test]: the plot is part of the check
    assert (out / "soak.png").read_bytes()[:4] == b"\x89PNG"
