"""Paired rounds: two servers up at once, the same scenarios against each in turn, the order
swapped every round, so that a drift of a shared machine's speed moves both alike; the figure to
quote is the median of the per-round ratios.

Owns what a round measures (the single stream's decode rates and the cold prefill's TTFTs), the
rounds against two running servers, and the table. It starts no server (benchmarks/peer.py does;
`ft bench serve --peer-url` measures two that are already up).
"""

from __future__ import annotations

import asyncio
import dataclasses
import sys
from typing import Any

from freetoken.bench import serving

PAIRED_SCENARIOS = ("single", "prefill")
Rounds = list[dict[str, dict[str, float]]]


def paired_measures(result: dict[str, Any]) -> dict[str, float]:
    """One server's figures of one paired round, by name (TTFTs end in ", s": lower is better)."""
    out = {
        f"single stream {kind}, tok/s": v["decode_tok_s"] for kind, v in result["scenarios"].get("single", {}).items()
    }
    out.update(
        {
            f"cold TTFT, {r['prompt_tokens']}-token prompt, s": r["ttft_s"]
            for r in result["scenarios"].get("prefill", [])
        }
    )
    for point in result["scenarios"].get("sweep", []):
        out[f"{point['concurrency']} streams total, tok/s"] = point["total_tok_s"]
    return out


def paired_table(rounds: Rounds, ours: str = "freetoken", peer: str = "llama-server") -> str:
    """A markdown table of the paired rounds: per measure each server's median and the median and
    range of the per-round ratios ours / peer."""
    lines = [f"| measure | {peer}, median | {ours}, median | ratio per round: median (min-max) |", "|---|---|---|---|"]
    for measure in rounds[0][peer] if rounds else ():
        pa = [r[peer][measure] for r in rounds]
        oa = [r[ours][measure] for r in rounds]
        ratios = [o / p for o, p in zip(oa, pa)]
        digits, note = (3, " (lower is better)") if measure.endswith(", s") else (1, "")
        lines.append(
            f"| {measure}{note} | {serving.percentile(pa, 50):.{digits}f} | {serving.percentile(oa, 50):.{digits}f} | "
            f"{serving.percentile(ratios, 50):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}x) |"
        )
    return "\n".join(lines)


def run_rounds(
    base_urls: dict[str, str], rounds: int, settings: serving.Settings, scenarios: tuple[str, ...] = PAIRED_SCENARIOS
) -> Rounds:
    """`rounds` rounds of `scenarios` against each server in turn (order swapped every round).
    Returns per round {server: {measure: value}}."""
    paired = dataclasses.replace(settings, scenarios=scenarios, progress=False)
    order = list(base_urls)
    results: Rounds = []
    for r in range(rounds):
        row: dict[str, dict[str, float]] = {}
        for name in order if r % 2 == 0 else order[::-1]:
            result = asyncio.run(serving.run(dataclasses.replace(paired, base_url=base_urls[name], label=name)))
            row[name] = paired_measures(result)
        print(f"paired round {r + 1}/{rounds}: {row}", file=sys.stderr)
        results.append(row)
    return results
