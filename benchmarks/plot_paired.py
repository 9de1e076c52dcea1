"""Bar chart of paired rounds (`benchmarks/peer.py --paired-rounds`): each measure's median over the
rounds for every server, decode rates on the left and cold TTFT on the right.

    python benchmarks/plot_paired.py RESULTS.json TITLE OUT.png

RESULTS.json is a list of rounds ({server: {measure: value}}) or {"rounds": [...]}.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(argv: list[str]) -> int:
    data = json.loads(Path(argv[0]).read_text())
    rounds = data["rounds"] if isinstance(data, dict) else data
    servers = list(rounds[0])
    measures = list(rounds[0][servers[0]])
    median = {s: {m: statistics.median(r[s][m] for r in rounds) for m in measures} for s in servers}
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, keep, label in ((axes[0], "tok/s", "tok/s (higher is better)"), (axes[1], "TTFT", "seconds (lower is better)")):
        ms = [m for m in measures if keep in m]
        width = 0.8 / len(servers)
        for i, s in enumerate(servers):
            ax.bar([j + i * width for j in range(len(ms))], [median[s][m] for m in ms], width, label=s)
        ax.set_xticks([j + width * (len(servers) - 1) / 2 for j in range(len(ms))])
        ax.set_xticklabels([m.replace(", tok/s", "").replace("cold TTFT, ", "").replace(", s", "") for m in ms],
                           rotation=20, ha="right", fontsize=8)
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
    fig.suptitle(f"{argv[1]} ({len(rounds)} paired round{'s' if len(rounds) > 1 else ''}, medians)")
    fig.tight_layout()
    fig.savefig(argv[2], dpi=110)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
