"""Speculative decoding beside llama-server's: decode tokens/s on an "edit this file" workload.

    python benchmarks/speculative.py [--model gemma3-270m] [--llama-server PATH] [--threads N]
                                     [--ft-drafts 4 8 16] [--out-dir bench-out] [--quick]

The prompt holds a source file (~1500 tokens by default: the head of freetoken/kv/manager.py)
and asks for it back, at temperature 0, streamed, one request at a time, as the same raw text
for both servers on /v1/completions (Gemma's turn format, `--turns`; the reply opens with the
code fence, so the model starts on the file, and the closing fence stops it):

- `repeat`: "Repeat the following file exactly" (what makes a 270M model copy faithfully);
- `edit`: "Rewrite the following file with `release` renamed to `drop`" (the issue's workload:
  the reply is the file with small changes; a small model may stray from it).

Servers, one after the other on the same GGUF and thread count: `ft serve` without speculation
and with `--speculative ngram --spec-max-draft K` for each K of `--ft-drafts`; llama-server
without speculation and with each of its n-gram settings (`--llama-specs`, default
ngram-simple at its defaults and at n=4/m=16, ngram-mod, ngram-map-k). Per server and
workload: the median decode rate (completion tokens after the first / time after the first),
completion tokens, how much of the reply is the file (difflib ratio: copying is what the drafts
exploit: the share of the reply's characters in runs of 8+ matching the file), and the
acceptance rate (FreeToken: /metrics; llama-server: the draft counts its log prints; over the
warm-up and both workloads). Prints a table and writes `speculative.json` + `speculative.md` to
`--out-dir`. Server processes, health waits and streaming come from peer.py and serving.py.
Numbers are figures only on an idle machine.
"""

from __future__ import annotations

import argparse
import asyncio
import difflib
import json
import os
import re
import shlex
import sys
from pathlib import Path
from typing import Any

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peer import (
    ServerProcess,
    free_port,
    ft_cmd,
    llama_cmd,
    model_path,
    serving,
    version,
)

REPO = Path(__file__).resolve().parents[1]
DEFAULT_SOURCE = REPO / "freetoken" / "kv" / "manager.py"
DEFAULT_LLAMA = Path("/opt/llamacpp/build/bin/llama-server")
LLAMA_SPECS = [
    "--spec-type ngram-simple",
    "--spec-type ngram-simple --spec-ngram-simple-size-n 4 --spec-ngram-simple-size-m 16",
    "--spec-type ngram-mod",
    "--spec-type ngram-map-k",
]
PROMPTS = {
    "repeat": "Repeat the following file exactly, with no commentary and nothing before or after it.",
    "edit": "Rewrite the following file with the method `release` renamed to `drop` everywhere. Output the whole file "
            "and nothing else.",
}
# The same raw text for both servers (/v1/completions; each adds its BOS): Gemma's turn format, with
# the reply opened by the code fence, so that the model starts on the file's first line.
GEMMA_TURNS = "<start_of_turn>user\n{instruction}\n\n```python\n{source}```<end_of_turn>\n<start_of_turn>model\n```python\n"


def source_text(path: Path, chars: int) -> str:
    """The file's head, cut at a line end near `chars` characters (code is ~4 characters a token)."""
    text = path.read_text()
    if len(text) <= chars:
        return text
    return text[: text.rindex("\n", 0, chars) + 1]


def fidelity(reply: str, source: str) -> float:
    """The share of the reply copied from the file: characters in blocks difflib matches
    between them, over the reply's length (1.0: every character is the file's)."""
    if not reply:
        return 0.0
    blocks = difflib.SequenceMatcher(None, reply, source, autojunk=False).get_matching_blocks()
    return sum(b.size for b in blocks if b.size >= 8) / len(reply)


async def measure(base_url: str, source: str, max_tokens: int, repeats: int, turns: str) -> dict[str, Any]:
    settings = serving.Settings(base_url=base_url, progress=False)
    srv = serving.Server(settings)
    await srv.discover_model()
    out: dict[str, Any] = {}
    # warm-up: one short request (first-call costs are not decode)
    await srv.stream("/v1/completions", {"prompt": turns.format(instruction="Say hi.", source=""), "max_tokens": 8,
                                         "temperature": 0.0})
    for name, instruction in PROMPTS.items():
        body = {"prompt": turns.format(instruction=instruction, source=source), "max_tokens": max_tokens,
                "temperature": 0.0, "ignore_eos": False, "stop": ["```"]}
        streams = [await srv.stream("/v1/completions", body) for _ in range(repeats)]
        rates = sorted(r for r in (s.decode_rate for s in streams) if r is not None)
        out[name] = {
            "decode_tok_s": rates[len(rates) // 2] if rates else None,
            "decode_tok_s_all": rates,
            "completion_tokens": streams[-1].completion_tokens,
            "prompt_tokens": streams[-1].prompt_tokens,
            "ttft_s": [s.ttft for s in streams],
            "fidelity": fidelity(streams[-1].text, source),
            "reply": streams[-1].text,
        }
    await srv.http.aclose()
    return out


def ft_acceptance(base_url: str) -> float | None:
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    drafted = re.search(r"^freetoken_spec_drafted_tokens (\S+)$", text, re.MULTILINE)
    accepted = re.search(r"^freetoken_spec_accepted_tokens (\S+)$", text, re.MULTILINE)
    if not drafted or not accepted or float(drafted.group(1)) == 0:
        return None
    return float(accepted.group(1)) / float(drafted.group(1))


def llama_acceptance(log: Path) -> float | None:
    """llama-server's own count, from its log's `draft acceptance = r (a accepted / g generated)`."""
    found = re.findall(r"draft acceptance = \S+ \(\s*(\d+) accepted /\s*(\d+) generated\)", log.read_text(errors="replace"))
    generated = sum(int(g) for _, g in found)
    return sum(int(a) for a, _ in found) / generated if generated else None


def run_server(label: str, cmd: list[str], port: int, log: Path, source: str, a: argparse.Namespace) -> dict[str, Any]:
    print(f"\n== {label}: {shlex.join(cmd)}", file=sys.stderr)
    server = ServerProcess(cmd, port, log)
    try:
        server.wait_healthy(a.start_timeout)
        result = asyncio.run(measure(server.base_url, source, a.max_tokens, a.repeats, a.turns))
        acceptance = ft_acceptance(server.base_url) if "serve" in cmd else None
    finally:
        server.stop()
    if "serve" not in cmd:
        acceptance = llama_acceptance(log)
    return {"label": label, "workloads": result, "acceptance": acceptance, "server": server.record() | {"version": version(cmd)}}


def fmt(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def table(runs: list[dict[str, Any]]) -> str:
    base = {w: next((r["workloads"][w]["decode_tok_s"] for r in runs if r["label"] == "ft serve"), None) for w in PROMPTS}
    lines = ["| server | " + " | ".join(f"{w} tok/s | {w} x ft-off | {w} tokens | {w} copy" for w in PROMPTS) + " | acceptance |",
             "|---|" + "---|" * (4 * len(PROMPTS)) + "---|"]
    for r in runs:
        cells = []
        for w in PROMPTS:
            m = r["workloads"][w]
            rate = m["decode_tok_s"]
            cells += [fmt(rate), fmt(rate / base[w] if rate and base[w] else None, 2), str(m["completion_tokens"]), fmt(m["fidelity"], 2)]
        lines.append(f"| {r['label']} | " + " | ".join(cells) + f" | {fmt(r['acceptance'], 2)} |")
    return "\n".join(lines)


def verdict(runs: list[dict[str, Any]]) -> str:
    """Per workload: FreeToken's best speculative run against its own run without, and against
    llama-server's best setting (the issue's two bars: >= 2x and ahead)."""
    lines = []
    for w in PROMPTS:
        def rate(r: dict[str, Any], w: str = w) -> float:
            return r["workloads"][w]["decode_tok_s"] or 0.0

        off = next((r for r in runs if r["label"] == "ft serve"), None)
        spec = max((r for r in runs if r["label"].startswith("ft serve ngram")), key=rate, default=None)
        llama = max((r for r in runs if r["label"].startswith("llama-server")), key=rate, default=None)
        if spec is None or off is None or not rate(off):
            continue
        line = f"- {w}: {spec['label']} {rate(spec):.1f} tok/s = {rate(spec) / rate(off):.2f}x ft serve without"
        if llama is not None and rate(llama):
            line += f", {rate(spec) / rate(llama):.2f}x llama-server's best ({llama['label']}, {rate(llama):.1f} tok/s)"
        lines.append(line)
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="gemma3-270m", help="short name or .gguf path")
    p.add_argument("--threads", type=int, default=psutil.cpu_count(logical=False) or os.cpu_count() or 1)
    p.add_argument("--llama-server", type=Path, default=DEFAULT_LLAMA if DEFAULT_LLAMA.exists() else None,
                   help=f"llama-server binary (default {DEFAULT_LLAMA} when present; none: FreeToken only)")
    p.add_argument("--llama-specs", nargs="*", default=LLAMA_SPECS, help="llama-server speculation settings to run besides none")
    p.add_argument("--ft-drafts", type=int, nargs="*", default=[4, 8, 16], help="--spec-max-draft values to run")
    p.add_argument("--ft-args", default="", help="extra ft serve flags (every FreeToken run)")
    p.add_argument("--source", type=Path, default=DEFAULT_SOURCE, help="the file the prompt holds")
    p.add_argument("--source-chars", type=int, default=5000, help="its head, in characters (~1500 Gemma tokens of this code)")
    p.add_argument("--max-tokens", type=int, default=1800)
    p.add_argument("--turns", default=GEMMA_TURNS, help="the raw prompt around {instruction} and {source} (default: Gemma's turns)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--ctx", type=int, default=8192, help="KV tokens of each server (-c, --num-tokens)")
    p.add_argument("--start-timeout", type=float, default=300.0)
    p.add_argument("--out-dir", default="bench-out")
    p.add_argument("--quick", action="store_true", help="a short file, 160 tokens, one repeat, K 8, ngram-simple only (a smoke run)")
    a = p.parse_args(argv)
    if a.quick:
        a.source_chars, a.max_tokens, a.repeats, a.ft_drafts, a.llama_specs = 1500, 160, 1, [8], LLAMA_SPECS[:1]
    gguf = model_path(a.model)
    source = source_text(a.source, a.source_chars)
    out_dir = Path(a.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    configs: list[tuple[str, list[str]]] = []
    for k in [None, *a.ft_drafts]:
        port = free_port()
        extra = a.ft_args + ("" if k is None else f" --speculative ngram --spec-max-draft {k}")
        configs.append(("ft serve" if k is None else f"ft serve ngram K={k}", ft_cmd(gguf, a.threads, a.ctx, port, extra)))
    if a.llama_server is not None:
        for spec in ["", *a.llama_specs]:
            port = free_port()
            configs.append((f"llama-server {spec or 'no spec'}", llama_cmd(a.llama_server, gguf, a.threads, 1, a.ctx, port, spec)))
    runs = []
    for label, cmd in configs:
        port = int(cmd[cmd.index("--port") + 1])
        slug = re.sub(r"[^a-z0-9]+", "-", label.lower()).strip("-")
        runs.append(run_server(label, cmd, port, out_dir / f"speculative-{slug}.log", source, a))
    head = (f"# Speculative decoding: {Path(gguf).name}, {a.threads} threads, one stream, temperature 0, "
            f"{runs[0]['workloads']['repeat']['prompt_tokens']} prompt tokens\n\n")
    text = head + table(runs) + "\n\n" + verdict(runs) + "\n"
    (out_dir / "speculative.md").write_text(text)
    (out_dir / "speculative.json").write_text(json.dumps({"settings": {k: str(v) for k, v in vars(a).items()}, "runs": runs}, indent=1))
    print("\n" + text)


if __name__ == "__main__":
    main(sys.argv[1:])
