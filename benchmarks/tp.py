"""Tensor parallelism against one process on the same machine (issue 13): what TP costs or buys.

    python benchmarks/tp.py [--model gemma3-270m] [--cores 2]

Runs `ft serve` three ways, one after the other: TP = 2 with cores / 2 threads per rank,
TP = 1 with every core, TP = 1 with cores / 2 threads (one rank's share alone); each through
benchmarks/serving.py's single-stream decode (greedy, 64 tokens, 5 repeats) and cold prefill
(512 and 1024 prompt tokens, 3 repeats). Prints a markdown table with ratios to TP = 1 on every
core. It changes no project code and asserts nothing; run it on an idle machine (`uptime`).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import peer  # noqa: E402
import serving  # noqa: E402


def run(label: str, model: str, tp: int, threads: int) -> dict[str, Any]:
    port = peer.free_port()
    cmd = peer.ft_cmd(peer.model_path(model), threads, 32768, port, f"--tensor-parallel-size {tp}")
    log = Path(tempfile.gettempdir()) / f"tp-{tp}x{threads}.log"
    server = peer.ServerProcess(cmd, port, log)
    try:
        server.wait_healthy(600)
        settings = serving.Settings(
            base_url=server.base_url, label=label, scenarios=("single", "prefill"), prefill_lengths=(512, 1024), progress=False,
        )
        result = asyncio.run(serving.run(settings))
    finally:
        server.stop()
    result["meta"]["load_avg_at_start"] = server.load_at_start
    return result


def figures(result: dict[str, Any]) -> dict[str, float | None]:
    sc = result["scenarios"]
    ttft = {row["prompt_tokens"]: row["ttft_s"] for row in sc["prefill"]}
    return {"decode tok/s": sc["single"]["greedy"]["decode_tok_s"], "TTFT 512 s": ttft.get(512), "TTFT 1024 s": ttft.get(1024)}


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--cores", type=int, default=len(os.sched_getaffinity(0)))
    a = ap.parse_args(argv)
    half = max(a.cores // 2, 1)
    configs = [("TP=2 x %d thread(s)" % half, 2, half), ("TP=1 x %d threads" % a.cores, 1, a.cores), ("TP=1 x %d thread(s)" % half, 1, half)]
    rows = [(label, figures(run(label, a.model, tp, threads))) for label, tp, threads in configs]
    base = rows[1][1]
    keys = list(base)
    print(f"\n{a.model}, {a.cores} cores, load average {os.getloadavg()[0]:.2f} at the end\n")
    print("| configuration | " + " | ".join(keys) + " |")
    print("|---|" + "---|" * len(keys))
    for label, f in rows:
        cells = [f"{f[k]:.3g} ({f[k] / base[k]:.2f}x)" if f[k] and base[k] else "-" for k in keys]
        print(f"| {label} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(sys.argv[1:])
