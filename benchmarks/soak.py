"""A long-run check of `ft serve`: agent traffic for a given duration, memory and KV sampled throughout.

    python benchmarks/soak.py --duration 3600 --conversations 4 --threads 1 --out bench-out/soak
    python benchmarks/soak.py --model tests-model-dir --duration 15 --interval 1 --out /tmp/soak   # a smoke run
    python benchmarks/soak.py --model tests-model-dir --requests 12 --conversations 3 --out /tmp/soak  # no clock (tests)

Starts its own `ft serve` (so it knows the processes whose memory it samples), then runs
`--conversations` concurrent tool-calling conversations over one long shared system prompt that
lists the tools: each turn is a chat completion whose tool call (forced through the grammar on
most turns, so any model makes real calls) gets a tool result fed back; a conversation starts
over after `--turns` turns, so contexts stay bounded and the prefix cache keeps turning over.

Every `--interval` seconds one CSV row: elapsed time, the RSS of the API process and of the engine
process(es), every pool's counts (capacity / free / cached / in_use / quarantined), the integrity
counters (audits, violations, quarantined pages), engine restarts and hangs, the longest gap
between two engine heartbeats, and the request, token and error totals so far. At the end it
stops the traffic, waits for idle, and writes `soak.csv`, `soak.json` (summary and verdict) and
`soak.png` (needs matplotlib; skipped with one line without it) into `--out`.

`--requests N` replaces the clock (what tests use, so a faster or slower machine gives the same
run): conversation k makes its share of exactly N requests, a sample is taken after each
completed request and before that conversation goes on (so no more than `--conversations`
requests complete between two samples), and `--warmup` counts completed requests.

It fails (exit 1, the reasons printed) on any request error, any integrity violation or
quarantined page, an engine restart, pools that do not balance at idle (nothing in use and
`capacity == free + cached + in_use + quarantined`), or total RSS growth past `--max-rss-growth-mb`
from the end of the warm-up (`--warmup`, default a tenth of the run) to the end of the run
(median of the last samples, so one busy sample does not decide).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

from freetoken.utils.ports import free_port

CITIES = ["Paris", "Oslo", "Lima", "Kyoto", "Accra"]
CITY = {"type": "object", "properties": {"city": {"type": "string", "enum": CITIES}}, "required": ["city"], "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather now in a city", "parameters": CITY}},
    {"type": "function", "function": {"name": "get_time", "description": "The local time in a city", "parameters": CITY}},
    {"type": "function", "function": {"name": "get_flights", "description": "Flights leaving a city today", "parameters": CITY}},
]
# Turn k of a conversation uses TURN_CHOICES[k % 4]: forced calls make real tool calls on any model.
TURN_CHOICES: list[Any] = ["required", {"type": "function", "function": {"name": "get_time"}}, "auto", "required"]
SYSTEM_SENTENCE = (
    "You are a careful travel agent. Answer with tools whenever a question needs live data, quote the tool "
    "results exactly, and keep every answer short. "
)
TAIL_SAMPLES = 5  # the RSS at the end is the median of this many last samples
IDLE_DEADLINE_S = 300.0


@dataclass
class Totals:
    """Shared by the conversation threads (under `lock`)."""

    requests: int = 0
    tool_calls: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    errors: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    sampled: int = 0  # --requests: completed requests the last sample covers

    def __post_init__(self) -> None:
        self.changed = threading.Condition(self.lock)  # --requests: a request completed, or a sample was taken

    def error(self, message: str) -> None:
        with self.lock:
            self.errors.append(message)
            self.changed.notify_all()
        print(f"soak: request error: {message[:300]}", file=sys.stderr, flush=True)


class Server:
    """`ft serve` as a child process with its log in `--out`."""

    def __init__(self, args: argparse.Namespace, out: Path) -> None:
        self.port = args.port or free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "freetoken.cli", "serve", "--port", str(self.port), "--served-model-name", "soak"]
        if args.model:
            cmd += ["--model", args.model]
        if args.threads:
            cmd += ["--threads", str(args.threads)]
        cmd += ["--max-running-requests", str(args.conversations), "--enable-cache-report", *args.serve_arg]
        self.cmd = cmd
        self.log_path = out / "serve.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, cwd=Path(__file__).resolve().parents[1])
        self.ps = psutil.Process(self.proc.pid)

    def wait_healthy(self, deadline_s: float) -> None:
        end = time.monotonic() + deadline_s
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise SystemExit(f"soak: ft serve exited with {self.proc.returncode}; see {self.log_path}")
            try:
                if httpx.get(f"{self.base}/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise SystemExit(f"soak: ft serve was not healthy after {deadline_s:.0f} s; see {self.log_path}")

    def engine_processes(self) -> list[psutil.Process]:
        """The engine process(es): every child of `ft serve` but multiprocessing's resource tracker."""
        found = []
        for child in self.ps.children(recursive=True):
            try:
                if "resource_tracker" not in " ".join(child.cmdline()):
                    found.append(child)
            except psutil.NoSuchProcess:
                continue
        return found

    def rss_mb(self) -> tuple[float, float]:
        """(API process, engine processes) resident memory in MiB."""
        api = self.ps.memory_info().rss
        engine = 0
        for child in self.engine_processes():
            try:
                engine += child.memory_info().rss
            except psutil.NoSuchProcess:
                continue
        return api / 2**20, engine / 2**20

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return int(self.proc.returncode)


def conversation(base: str, k: int, args: argparse.Namespace, system: str, totals: Totals, stop: threading.Event) -> None:
    """Conversations one after another until `stop` (or, with --requests, until this
    conversation's share of the requests is done); each turn waits for its answer."""
    generation = 0
    quota = None if args.requests is None else args.requests // args.conversations + (k < args.requests % args.conversations)
    made = 0
    with httpx.Client(base_url=base, timeout=args.request_timeout) as c:
        while not stop.is_set() and (quota is None or made < quota):
            messages: list[dict[str, Any]] = [{"role": "system", "content": system}]
            for turn in range(args.turns):
                if stop.is_set() or (quota is not None and made >= quota):
                    return
                city = CITIES[(k + turn + generation) % len(CITIES)]
                messages.append({"role": "user", "content": f"Traveller {k}.{generation}, question {turn}: what about {city}?"})
                choice = TURN_CHOICES[turn % len(TURN_CHOICES)]
                body = {"model": "soak", "messages": messages, "tools": TOOLS, "tool_choice": choice,
                        "max_tokens": args.max_tokens, "temperature": 0.8, "seed": 1000 * k + 10 * generation + turn}
                where = f"conversation {k}.{generation} turn {turn}"
                try:
                    r = c.post("/v1/chat/completions", json=body)
                except httpx.HTTPError as err:
                    totals.error(f"{where}: {type(err).__name__}: {err}")
                    return
                if r.status_code != 200:
                    totals.error(f"{where}: HTTP {r.status_code} {r.text}")
                    return
                out = r.json()
                usage = out["usage"]
                message = out["choices"][0]["message"]
                calls = message.get("tool_calls") or []
                with totals.lock:
                    totals.requests += 1
                    mine = totals.requests
                    totals.tool_calls += len(calls)
                    totals.prompt_tokens += usage["prompt_tokens"]
                    totals.completion_tokens += usage["completion_tokens"]
                    totals.cached_tokens += (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                    totals.changed.notify_all()
                    if quota is not None:  # go on once a sample covers this request
                        totals.changed.wait_for(lambda: totals.sampled >= mine or stop.is_set())
                made += 1
                if out["choices"][0]["finish_reason"] == "error":
                    totals.error(f"{where}: finish_reason error: {out}")
                    return
                messages.append({"role": "assistant", "content": message.get("content"), **({"tool_calls": calls} if calls else {})})
                for call in calls:
                    try:
                        call_args = json.loads(call["function"]["arguments"])
                    except ValueError:
                        call_args = {}
                    result = {"city": call_args.get("city"), "value": f"{call['function']['name']} result {k}.{generation}.{turn}"}
                    messages.append({"role": "tool", "tool_call_id": call["id"], "content": json.dumps(result)})
            generation += 1


def rows_wanted(totals: Totals, rows: list[dict[str, Any]], args: argparse.Namespace) -> bool:
    """--requests: wait until a request completed since the last sample (True: take one), or
    every request is done and sampled, or one failed (False). The first sample is taken at once."""
    if not rows:
        return True
    with totals.lock:
        totals.changed.wait_for(lambda: totals.requests > totals.sampled or bool(totals.errors) or totals.requests >= args.requests,
                                timeout=args.request_timeout)  # a hang guard: each wait is one request at most
        return totals.requests > totals.sampled and not totals.errors


def metric_value(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def sample(server: Server, t0: float, totals: Totals) -> dict[str, Any]:
    api_mb, engine_mb = server.rss_mb()
    row: dict[str, Any] = {"elapsed_s": round(time.monotonic() - t0, 1), "rss_api_mb": round(api_mb, 1),
                           "rss_engine_mb": round(engine_mb, 1), "rss_total_mb": round(api_mb + engine_mb, 1)}
    status = httpx.get(f"{server.base}/v1/cache/status", timeout=60).json()
    for pool in ("full", "swa", "state"):  # state: a hybrid model's recurrent-state slots
        counts = status["pools"].get(pool) or {}
        for state in ("capacity", "free", "cached", "in_use", "quarantined"):
            row[f"{pool}_{state}"] = counts.get(state, "")
    integrity = status["integrity"]
    row.update(audits=integrity["audits"], violations=integrity["violations"], quarantined_pages=integrity["quarantined_pages"],
               restarts=status["engine"]["restarts"], in_flight=status["engine"]["in_flight"])
    metrics = httpx.get(f"{server.base}/metrics", timeout=60).text
    row.update(hangs=metric_value(metrics, "freetoken_engine_hangs"),
               heartbeat_max_gap_s=metric_value(metrics, "freetoken_engine_heartbeat_max_gap_seconds"))
    with totals.lock:
        row.update(requests=totals.requests, tool_calls=totals.tool_calls, prompt_tokens=totals.prompt_tokens,
                   completion_tokens=totals.completion_tokens, cached_tokens=totals.cached_tokens, errors=len(totals.errors))
    return row


def wait_idle(server: Server) -> dict[str, Any]:
    end = time.monotonic() + IDLE_DEADLINE_S
    while True:
        status = httpx.get(f"{server.base}/v1/cache/status", timeout=60).json()
        if status["engine"]["in_flight"] == 0 and all(p["in_use"] == 0 for p in status["pools"].values()):
            return status
        if time.monotonic() > end:
            return status
        time.sleep(0.5)


def verdict(rows: list[dict[str, Any]], idle: dict[str, Any], totals: Totals, args: argparse.Namespace) -> tuple[list[str], dict[str, Any]]:
    """The reasons the run failed (empty: passed) and the figures of the summary."""
    failures = [f"{len(totals.errors)} request error(s), first: {totals.errors[0][:300]}"] if totals.errors else []
    integrity = idle["integrity"]
    if integrity["violations"] or integrity["quarantined_pages"]:
        failures.append(f"integrity: {integrity}")
    if idle["engine"]["restarts"]:
        failures.append(f"the engine restarted {idle['engine']['restarts']} time(s)")
    for name, pool in idle["pools"].items():
        if pool["in_use"] or pool["capacity"] != pool["free"] + pool["cached"] + pool["in_use"] + pool["quarantined"]:
            failures.append(f"pool {name} unbalanced at idle: {pool}")
    after = [r for r in rows if (r["elapsed_s"] if args.requests is None else r["requests"]) >= args.warmup]
    growth = None
    if len(after) >= 2:
        base = after[0]["rss_total_mb"]
        end = statistics.median(r["rss_total_mb"] for r in after[-TAIL_SAMPLES:])
        growth = round(end - base, 1)
        if growth > args.max_rss_growth_mb:
            failures.append(f"RSS grew {growth} MiB after the warm-up (bound {args.max_rss_growth_mb} MiB)")
    else:
        failures.append("too few samples after the warm-up to judge the RSS")
    if totals.requests == 0:
        failures.append("no request completed")
    summary = {
        "duration_s": args.duration, "conversations": args.conversations, "requests": totals.requests,
        "tool_calls": totals.tool_calls, "prompt_tokens": totals.prompt_tokens, "completion_tokens": totals.completion_tokens,
        "cached_tokens": totals.cached_tokens, "errors": len(totals.errors), "rss_growth_after_warmup_mb": growth,
        "rss_total_mb_first": rows[0]["rss_total_mb"] if rows else None, "rss_total_mb_max": max((r["rss_total_mb"] for r in rows), default=None),
        "heartbeat_max_gap_s": max((r["heartbeat_max_gap_s"] for r in rows), default=None),
        "idle_pools": idle["pools"], "integrity": integrity, "restarts": idle["engine"]["restarts"],
    }
    return failures, summary


def plot(rows: list[dict[str, Any]], path: Path, warmup: float) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("soak: matplotlib is not installed: no plot (pip install matplotlib)", file=sys.stderr)
        return False
    t = [r["elapsed_s"] / 60 for r in rows]
    fig, (ax1, ax2, ax3) = plt.subplots(3, 1, figsize=(9, 9), sharex=True)
    ax1.plot(t, [r["rss_total_mb"] for r in rows], label="total")
    ax1.plot(t, [r["rss_engine_mb"] for r in rows], label="engine process")
    ax1.plot(t, [r["rss_api_mb"] for r in rows], label="API process")
    ax1.axvline(warmup / 60, color="grey", linestyle=":", label="end of warm-up")
    ax1.set_ylabel("RSS (MiB)")
    ax1.legend(loc="center right")
    for pool, style in (("full", "-"), ("swa", "--"), ("state", ":")):
        if rows and rows[0][f"{pool}_capacity"] != "":
            for state in ("free", "cached", "in_use"):
                ax2.plot(t, [r[f"{pool}_{state}"] for r in rows], style, label=f"{pool} {state}")
    ax2.set_ylabel("KV pages")
    ax2.legend(loc="center right", fontsize="small", ncol=2)
    ax3.plot(t, [r["requests"] for r in rows], label="requests done")
    ax3.plot(t, [r["errors"] for r in rows], label="request errors")
    ax3.plot(t, [r["violations"] for r in rows], label="audit violations")
    ax3.set_ylabel("count")
    ax3.set_xlabel("minutes")
    ax3.legend(loc="center right")
    fig.suptitle("ft serve soak: RSS, KV pools, requests")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="what `ft serve --model` gets (default: its default, gemma3-270m)")
    p.add_argument("--duration", type=float, default=3600.0, help="seconds of traffic (default 3600)")
    p.add_argument("--requests", type=int, default=None,
                   help="instead of --duration and --interval: exactly this many requests, a sample after each (no clock; for tests)")
    p.add_argument("--conversations", type=int, default=4, help="concurrent conversations; also --max-running-requests (default 4)")
    p.add_argument("--turns", type=int, default=8, help="turns before a conversation starts over (default 8)")
    p.add_argument("--max-tokens", type=int, default=64, help="max_tokens of each turn (default 64)")
    p.add_argument("--system-sentences", type=int, default=40, help="the shared system prompt is this sentence repeated (default 40, ~1,100 tokens)")
    p.add_argument("--interval", type=float, default=5.0, help="seconds between samples (default 5)")
    p.add_argument("--warmup", type=float, default=None, help="seconds before the RSS baseline (default: a tenth of --duration)")
    p.add_argument("--max-rss-growth-mb", type=float, default=64.0, help="allowed RSS growth after the warm-up, MiB (default 64)")
    p.add_argument("--threads", type=int, default=None, help="ft serve --threads")
    p.add_argument("--port", type=int, default=None)
    p.add_argument("--request-timeout", type=float, default=600.0, help="client timeout per request, seconds (default 600)")
    p.add_argument("--ready-timeout", type=float, default=600.0, help="how long ft serve may take to become healthy (default 600)")
    p.add_argument("--serve-arg", action="append", default=[], metavar="ARG", help="an extra `ft serve` argument (repeatable; e.g. --serve-arg=--debug-kv)")
    p.add_argument("--out", type=Path, default=Path("bench-out/soak"), help="directory for soak.csv, soak.json, soak.png, serve.log")
    args = p.parse_args(argv)
    if args.warmup is None:
        args.warmup = args.duration / 10 if args.requests is None else args.requests // 10
    if args.requests is not None and args.requests < args.conversations:
        p.error("--requests must be at least --conversations")
    return args


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    for sig in (signal.SIGINT, signal.SIGTERM):  # also when started in the background (SIGINT ignored)
        signal.signal(sig, _interrupt)  # the `finally` below then stops the server it started
    args.out.mkdir(parents=True, exist_ok=True)
    server = Server(args, args.out)
    print(f"soak: {' '.join(server.cmd)}", flush=True)
    rows: list[dict[str, Any]] = []
    totals = Totals()
    stop = threading.Event()
    try:
        server.wait_healthy(args.ready_timeout)
        system = SYSTEM_SENTENCE * args.system_sentences
        workers = [threading.Thread(target=conversation, args=(server.base, k, args, system, totals, stop), daemon=True)
                   for k in range(args.conversations)]
        t0 = time.monotonic()
        for w in workers:
            w.start()
        with open(args.out / "soak.csv", "w", newline="") as f:
            writer: csv.DictWriter[str] | None = None
            while (time.monotonic() - t0 < args.duration) if args.requests is None else rows_wanted(totals, rows, args):
                row = sample(server, t0, totals)
                rows.append(row)
                if writer is None:
                    writer = csv.DictWriter(f, fieldnames=list(row))
                    writer.writeheader()
                writer.writerow(row)
                f.flush()
                if row["errors"] or row["violations"]:
                    break  # a failed run says so now, not in an hour
                if args.requests is not None:
                    with totals.lock:
                        totals.sampled = row["requests"]
                        totals.changed.notify_all()
                    continue
                time.sleep(max(0.0, args.interval - (time.monotonic() - t0 - row["elapsed_s"])))
            stop.set()
            with totals.lock:
                totals.changed.notify_all()
            for w in workers:
                w.join(args.request_timeout)
            idle = wait_idle(server)
            row = sample(server, t0, totals)
            rows.append(row)
            if writer is not None:
                writer.writerow(row)
    finally:
        stop.set()
        code = server.stop()
    failures, summary = verdict(rows, idle, totals, args)
    if code != 0:
        failures.append(f"ft serve exited with {code} on SIGTERM (expected 0 after a drain)")
    summary.update(serve_command=" ".join(server.cmd), serve_exit_code=code, passed=not failures, failures=failures)
    (args.out / "soak.json").write_text(json.dumps(summary, indent=2))
    plot(rows, args.out / "soak.png", args.warmup)
    print(json.dumps({k: v for k, v in summary.items() if k not in ("idle_pools",)}, indent=1))
    for reason in failures:
        print(f"soak: FAILED: {reason}", file=sys.stderr)
    if not failures:
        print(f"soak: passed ({len(rows)} samples in {args.out})")
    return 1 if failures else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
