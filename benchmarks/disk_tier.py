"""The KV disk tier's goals (issue 29), measured against real `ft serve` processes.

    python benchmarks/disk_tier.py --out bench-out/disk_tier                     # gemma3-270m
    python benchmarks/disk_tier.py --model DIR --threads 4 --system-repeats 40 --out /tmp/dt

An agent workload: `--conversations` conversations (default 4) over one long shared system
prompt, `--turns` turns each (default 8), greedy, streamed (TTFT is the time to the first
content chunk), one conversation turn after another. With `--kv-disk-dir` on: after turn
`--kill-after` the engine process is SIGKILLed (the supervisor restarts it), after turn
`--term-after` the whole server gets SIGTERM and a new one starts over the same directory. Then
other traffic (unique prompts worth twice the pool) evicts conversation 0 from memory, and its next
turn comes back. A second server with no prefix cache (`--cache-type naive`) answers the same
prompts of every turn after a restart and the evicted one: their cold TTFT and their greedy text.

The verdict (in `disk_tier.json`): after each restart every conversation's next turn reports
>= 90% of its prompt cached and a TTFT <= 0.25x the cold TTFT of the same prompt; the evicted
conversation comes back with >= 90% cached; the greedy texts with and without the tier are the same.
Before each kill the script waits (up to 10 s) for the write backlog to drain and records what was
left. Run it on an idle machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import soak  # noqa: E402 - the sibling script: its Server

MODEL = "soak"
PARAGRAPH = (
    "You are a careful coding agent. You read the repository before you change it, you run the tests "
    "that cover what you touched, and you explain each change in one short paragraph. "
)


def stream_chat(base: str, messages: list[dict[str, str]], max_tokens: int) -> tuple[float, str, dict[str, Any]]:
    """(TTFT seconds, text, usage) of one greedy streamed chat completion."""
    body = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    ttft, text, usage = None, [], {}
    with httpx.Client(timeout=1800) as c, c.stream("POST", f"{base}/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise SystemExit(f"disk_tier: {r.status_code} {r.read()!r}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                usage = event["usage"]
            for choice in event.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    if ttft is None:
                        ttft = time.perf_counter() - start
                    text.append(piece)
    return (ttft if ttft is not None else time.perf_counter() - start), "".join(text), usage


def status(base: str) -> dict[str, Any]:
    return httpx.get(f"{base}/v1/cache/status", timeout=60).json()


def drained(base: str, deadline_s: float = 10.0) -> int:
    """Wait for the disk writer's backlog to drain; the pages left in it."""
    end = time.monotonic() + deadline_s
    left = status(base).get("disk", {}).get("write_backlog", 0)
    while left and time.monotonic() < end:
        time.sleep(0.1)
        left = status(base)["disk"]["write_backlog"]
    return left


def server(args: argparse.Namespace, out: Path, extra: list[str]) -> soak.Server:
    ns = argparse.Namespace(
        model=args.model,
        threads=args.threads,
        conversations=args.conversations,
        port=None,
        serve_arg=[*args.serve_arg, "--num-tokens", str(args.num_tokens), *extra],
    )
    out.mkdir(parents=True, exist_ok=True)
    s = soak.Server(ns, out)
    s.wait_healthy(900)
    return s


def engine_pid(base: str) -> int:
    return int(httpx.get(f"{base}/health", timeout=30).json()["pid"])


def run(args: argparse.Namespace) -> dict[str, Any]:
    out = Path(args.out)
    disk = out / "kv-disk"
    shutil.rmtree(disk, ignore_errors=True)
    system = PARAGRAPH * args.system_repeats
    convs: list[list[dict[str, str]]] = [[{"role": "system", "content": system}] for _ in range(args.conversations)]
    turns: list[dict[str, Any]] = []
    watch: list[tuple[str, int, list[dict[str, str]], dict[str, Any]]] = []  # (why, conv, messages, row)
    tier = ["--kv-disk-dir", str(disk), "--kv-disk-gb", str(args.disk_gb)]
    s = server(args, out / "tier", tier)
    restarted: str | None = None
    for t in range(args.turns):
        for k, messages in enumerate(convs):
            messages.append({"role": "user", "content": f"Task {k}.{t}: fix issue number {100 * k + t} and report."})
            ttft, text, usage = stream_chat(s.base, messages, args.max_tokens)
            prompt = usage.get("prompt_tokens", 0)
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            row = {"turn": t, "conv": k, "prompt_tokens": prompt, "cached_tokens": cached, "ttft_s": ttft}
            turns.append(row)
            if restarted is not None:
                watch.append((restarted, k, [dict(m) for m in messages], row | {"text": text}))
            messages.append({"role": "assistant", "content": text})
        restarted = None
        if t == args.kill_after:
            row = {"event": "sigkill", "backlog_left": drained(s.base)}
            pid = engine_pid(s.base)
            os.kill(pid, signal.SIGKILL)
            end = time.monotonic() + 900
            while time.monotonic() < end:
                try:
                    if engine_pid(s.base) != pid:
                        break
                except (httpx.HTTPError, KeyError, ValueError):
                    pass
                time.sleep(0.5)
            turns.append(row)
            restarted = "after SIGKILL"
        if t == args.term_after:
            turns.append({"event": "sigterm", "backlog_left": drained(s.base)})
            s.stop()
            s = server(args, out / "tier2", tier)
            restarted = "after SIGTERM restart"
    # Other traffic evicts conversation 0 from the pools; its next turn comes back from disk.
    filler = 0
    while filler < 2 * args.num_tokens:
        ttft, _, usage = stream_chat(
            s.base, [{"role": "user", "content": f"Unrelated request {filler}: " + PARAGRAPH[::-1] * 8}], 1
        )
        filler += usage.get("prompt_tokens", 1)
    convs[0].append({"role": "user", "content": "Back after a long pause: summarise what you did."})
    ttft, text, usage = stream_chat(s.base, convs[0], args.max_tokens)
    row = {
        "turn": args.turns,
        "conv": 0,
        "prompt_tokens": usage.get("prompt_tokens", 0),
        "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
        "ttft_s": ttft,
    }
    turns.append(row)
    watch.append(("evicted by other traffic", 0, [dict(m) for m in convs[0]], row | {"text": text}))
    disk_status = status(s.base).get("disk")
    s.stop()

    cold_server = server(args, out / "cold", ["--cache-type", "naive"])
    checks = []
    for why, k, messages, row in watch:
        cold_ttft, cold_text, _ = stream_chat(cold_server.base, messages, args.max_tokens)
        checks.append(
            {
                "why": why,
                "conv": k,
                "prompt_tokens": row["prompt_tokens"],
                "cached_fraction": row["cached_tokens"] / max(1, row["prompt_tokens"]),
                "ttft_s": row["ttft_s"],
                "cold_ttft_s": cold_ttft,
                "ttft_ratio": row["ttft_s"] / cold_ttft,
                "same_text": row["text"] == cold_text,
            }
        )
    cold_server.stop()
    failures = [
        f"{c['why']} conv {c['conv']}: {what}"
        for c in checks
        for what, bad in (
            (f"cached {c['cached_fraction']:.2f} < 0.90", c["cached_fraction"] < 0.9),
            (
                f"TTFT {c['ttft_ratio']:.2f}x the cold one > 0.25x",
                c["why"] != "evicted by other traffic" and c["ttft_ratio"] > 0.25,
            ),
            ("greedy text differs from the cold run's", not c["same_text"]),
        )
        if bad
    ]
    return {
        "load_average": os.getloadavg(),
        "turns": turns,
        "checks": checks,
        "disk": disk_status,
        "passed": not failures,
        "failures": failures,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="--model for ft serve (default: its default, gemma3-270m)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--conversations", type=int, default=4)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--kill-after", type=int, default=2, help="SIGKILL the engine after this turn")
    p.add_argument("--term-after", type=int, default=5, help="SIGTERM the server after this turn, start a new one")
    p.add_argument("--system-repeats", type=int, default=40, help="the shared system prompt: a paragraph this often")
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--num-tokens", type=int, default=16384, help="--num-tokens of the servers (the pool)")
    p.add_argument("--disk-gb", type=float, default=4.0)
    p.add_argument("--serve-arg", action="append", default=[], help="one more ft serve argument (repeatable)")
    p.add_argument("--out", default="bench-out/disk_tier")
    args = p.parse_args(argv)
    summary = run(args)
    out = Path(args.out)
    (out / "disk_tier.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: summary[k] for k in ("checks", "passed", "failures")}, indent=1))
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
