"""`benchmarks/chaos.py`, short: every traffic kind (tool-calling agents, Responses chains, pinned
chat and Anthropic requests, speculative greedy completions, streams and requests dropped by the
client) against one `ft serve` with n-gram speculation, int8 K/V, the SWA pool at its floor,
`--debug-kv`, pool resizes and two engine SIGKILLs, on the tiny sliding-window model.

No clock: `--requests` makes the run exactly 42 units over 3 workers, the resizes come every 7
completed units and the kills after 14 and 28. The script's own verdict must pass: no error
outside a kill window, no violation, restarts == kills, balanced pools at idle, every kind done,
the same greedy probe before and after. Run twice: without and with the KV disk tier. And once on
the tiny Qwen3.5 hybrid (`--hybrid`: no speculation, no SWA pool; the recurrent-state slots must
balance at idle too, the snapshots as `cached`)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("tier", ["memory", "disk"])
def test_short_chaos_run_passes(tiny_gemma_4k_dir: Path, tmp_path: Path, tier: str) -> None:
    """`disk`: with the KV disk tier on (`--kv-disk-dir`): its pages survive the kills and are
    loaded by the new engines, under the same verdict."""
    out = tmp_path / "chaos"
    disk = ["--serve-arg=--kv-disk-dir", f"--serve-arg={tmp_path / 'kv-disk'}"] if tier == "disk" else []
    cmd = [
        sys.executable, "benchmarks/chaos.py", "--model", str(tiny_gemma_4k_dir), "--requests", "42", "--workers", "3",
        "--kills", "2", "--resize-every-requests", "7", "--threads", "1", "--out", str(out),
        "--serve-arg=--dtype", "--serve-arg=float32", "--serve-arg=--page-size", "--serve-arg=4",
        "--serve-arg=--num-tokens", "--serve-arg=8192", *disk,
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    summary = json.loads((out / "chaos.json").read_text())
    assert summary["passed"] and summary["unexpected_errors"] == 0, summary
    assert summary["kills"] == 2 and summary["restarts"] == 2, summary
    assert all(n > 0 for n in summary["done"].values()), summary["done"]
    assert summary["resizes"]["applied"] + summary["resizes"]["refused_409"] >= 4, summary["resizes"]
    assert summary["probes"][0] == summary["probes"][1] and summary["probes"][0], summary["probes"]
    assert summary["audits"] > 0 and summary["serve_exit_code"] == 0, summary
    if tier == "disk":  # each engine the supervisor restarted found the pages the killed one wrote
        found = re.findall(r"disk tier: \S+, (\d+) pages on disk", (out / "serve.log").read_text())
        assert len(found) == 3 and all(int(n) > 0 for n in found[1:]), found


def test_short_chaos_run_passes_on_the_hybrid_model(tmp_path: Path) -> None:
    from tiny_models import write_tiny_model

    model = write_tiny_model("qwen3_5", tmp_path / "tiny-qwen3_5", max_position_embeddings=4096)
    out = tmp_path / "chaos"
    cmd = [
        sys.executable, "benchmarks/chaos.py", "--hybrid", "--model", str(model), "--requests", "42", "--workers", "3",
        "--kills", "2", "--resize-every-requests", "7", "--threads", "1", "--out", str(out),
        "--serve-arg=--dtype", "--serve-arg=float32", "--serve-arg=--page-size", "--serve-arg=4",
        "--serve-arg=--num-tokens", "--serve-arg=8192",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    summary = json.loads((out / "chaos.json").read_text())
    assert summary["passed"] and summary["unexpected_errors"] == 0, summary
    assert summary["kills"] == 2 and summary["restarts"] == 2, summary
    assert all(n > 0 for n in summary["done"].values()), summary["done"]
    assert "--speculative" not in summary["serve_command"] and "--swa-pool-tokens" not in summary["serve_command"]
    state = summary["idle_pools"]["state"]
    assert state["in_use"] == 0 and state["capacity"] == state["free"] + state["cached"] + state["quarantined"], state
    assert summary["probes"][0] == summary["probes"][1] and summary["probes"][0], summary["probes"]
    assert summary["audits"] > 0 and summary["serve_exit_code"] == 0, summary
