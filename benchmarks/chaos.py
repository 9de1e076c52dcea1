"""A chaos soak of `ft serve`: every feature on at once, mixed traffic, resizes and engine kills.

    python benchmarks/chaos.py --duration 1800 --out bench-out/chaos                 # the 30-minute run
    python benchmarks/chaos.py --model tests-model-dir --requests 60 --out /tmp/chaos   # no clock (tests)

Starts `ft serve` (soak.py's `Server`) with n-gram speculation, int8 K/V, the SWA pool at its
floor, pins on, `--debug-kv` (every step audited) and any `--serve-arg`, then runs `--workers`
threads, each cycling through the traffic kinds:

- `agent`: a tool-calling turn (tool_choice forced), the tool's result fed back, a second turn;
- `responses`: a three-turn `/v1/responses` chain over `previous_response_id`, the last streamed;
- `pinned`: a chat completion with `prompt_cache_key` over a shared system prompt (a pin);
- `anthropic`: `/v1/messages` with a `cache_control` breakpoint on the system prompt (a pin);
- `speculative`: a greedy completion of a repetitive prompt (n-gram drafts get accepted);
- `stream_drop`: a stream read for a few events and closed (a client disconnect mid-stream);
- `request_drop`: a long non-streamed request whose client gives up (a disconnect before any byte).

Meanwhile a chaos thread resizes the FULL and SWA pools (a hybrid's state pool too) down and back up every `--resize-every`
seconds (a 409, refused because running requests hold the pages, is an answer, not an error) and
SIGKILLs the engine process `--kills` times, spread over the run, waiting for `/health` after each.
With `--requests N` there is no clock: the resizes come every `--resize-every-requests`
completed units and the kills at fixed fractions of N.

`--hybrid`: a model with linear-attention layers (Qwen3.5 / Qwen3.5-MoE), which refuses
`--speculative` and has no SWA pool: both flags are left out (the `speculative` kind is then a plain
greedy completion of a repetitive prompt) and the recurrent-state pool (`pools.state`: a slot per
running request, the rest snapshots) is checked at idle like the page pools.

An error is expected only when its request overlapped a kill (from the SIGKILL until `/health`
answered 200 again); any other error fails the run. Also failed: an audit violation or a
quarantined page in any sample (samples are taken every `--interval` seconds, after each unit with
`--requests`, and just before each kill, since the engine's counters restart with it), engine
restarts != kills, pools unbalanced at idle, a kind that never succeeded, or a greedy probe (32
tokens) at the end that differs from the one at the start. Writes `chaos.json` (summary,
verdict), `chaos.csv` (samples) and `chaos.png` into `--out`.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import soak  # noqa: E402 - the sibling script: its Server, sampling and plot

KINDS = ("agent", "responses", "pinned", "anthropic", "speculative", "stream_drop", "request_drop")
SYSTEM = "You are a terse assistant for a travel desk. Use the tools when asked about live data. " * 6
PROBE = "The three primary colours are"
REPEAT = "alpha beta gamma delta epsilon " * 12


@dataclass
class Ledger:
    """What every thread reports (under `lock`)."""

    done: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    errors: list[dict[str, Any]] = field(default_factory=list)  # {kind, start, end, message}
    kills: list[list[float]] = field(default_factory=list)  # [sigkill time, healthy-again time or inf]
    resizes: dict[str, int] = field(default_factory=lambda: {"applied": 0, "refused_409": 0})
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.changed = threading.Condition(self.lock)

    @property
    def units(self) -> int:
        return sum(self.done.values()) + len(self.errors)

    def record(self, kind: str, start: float, error: str | None) -> None:
        with self.lock:
            if error is None:
                self.done[kind] += 1
            else:
                self.errors.append({"kind": kind, "start": start, "end": time.monotonic(), "message": error[:400]})
            self.changed.notify_all()

    def unexpected(self) -> list[dict[str, Any]]:
        """Errors whose request did not overlap a kill window."""
        with self.lock:
            return [e for e in self.errors if not any(e["start"] <= end and e["end"] >= kill for kill, end in self.kills)]


def _check(r: httpx.Response) -> dict[str, Any]:
    if r.status_code != 200:
        raise RuntimeError(f"HTTP {r.status_code} {r.text[:300]}")
    return r.json()


def _stream_events(c: httpx.Client, path: str, body: dict[str, Any], limit: int | None = None) -> int:
    """POST a stream and read its events (all, or `limit` then close); an error event raises."""
    n = 0
    with c.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code} {r.read()[:300]!r}")
        for line in r.iter_lines():
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            event = json.loads(line[5:])
            if "error" in event and event.get("type") != "response.output_text.delta":
                raise RuntimeError(f"stream error event: {str(event)[:300]}")
            n += 1
            if limit is not None and n >= limit:
                return n
    return n


def agent(c: httpx.Client, w: int, i: int) -> None:
    city = soak.CITIES[(w + i) % len(soak.CITIES)]
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM},
                                      {"role": "user", "content": f"Agent {w}.{i}: weather in {city}?"}]
    out = _check(c.post("/v1/chat/completions", json={"model": "soak", "messages": messages, "tools": soak.TOOLS,
                                                       "tool_choice": "required", "max_tokens": 48, "temperature": 0.7, "seed": i}))
    calls = out["choices"][0]["message"].get("tool_calls") or []
    messages.append({"role": "assistant", "content": None, "tool_calls": calls})
    for call in calls:
        messages.append({"role": "tool", "tool_call_id": call["id"], "content": json.dumps({"city": city, "sky": "clear"})})
    _check(c.post("/v1/chat/completions", json={"model": "soak", "messages": messages, "tools": soak.TOOLS,
                                                 "max_tokens": 32, "temperature": 0.7, "seed": i}))


def responses(c: httpx.Client, w: int, i: int) -> None:
    first = _check(c.post("/v1/responses", json={"model": "soak", "instructions": SYSTEM, "input": f"Plan {w}.{i}: pick a city.",
                                                  "max_output_tokens": 24, "store": True}))
    second = _check(c.post("/v1/responses", json={"model": "soak", "previous_response_id": first["id"],
                                                   "input": "Why that one?", "max_output_tokens": 24, "store": True}))
    _stream_events(c, "/v1/responses", {"model": "soak", "previous_response_id": second["id"], "input": "And the weather?",
                                        "max_output_tokens": 24, "stream": True})


def pinned(c: httpx.Client, w: int, i: int) -> None:
    _check(c.post("/v1/chat/completions", json={
        "model": "soak", "prompt_cache_key": "desk", "max_tokens": 24, "temperature": 0.5, "seed": i,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Pinned {w}.{i}: hello"}]}))


def anthropic(c: httpx.Client, w: int, i: int) -> None:
    _check(c.post("/v1/messages", json={
        "model": "soak", "max_tokens": 24,
        "system": [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}],
        "messages": [{"role": "user", "content": f"Anthropic {w}.{i}: hello"}]}))


def speculative(c: httpx.Client, w: int, i: int) -> None:
    _check(c.post("/v1/completions", json={"model": "soak", "prompt": f"{w}.{i} {REPEAT}", "max_tokens": 48, "temperature": 0}))


def stream_drop(c: httpx.Client, w: int, i: int) -> None:
    _stream_events(c, "/v1/chat/completions", {"model": "soak", "stream": True, "max_tokens": 400,
                                               "messages": [{"role": "user", "content": f"Tell a long story {w}.{i}."}]}, limit=3)


def request_drop(c: httpx.Client, w: int, i: int) -> None:
    try:  # on any machine this model cannot write 2000 tokens within 0.3 s; if one did, it was answered, not an error
        _check(c.post("/v1/completions", json={"model": "soak", "prompt": f"Drop {w}.{i}:", "max_tokens": 2000, "ignore_eos": True},
                      timeout=httpx.Timeout(60, read=0.3)))
    except httpx.ReadTimeout:
        return  # the disconnect this kind is for


ACTIONS = {"agent": agent, "responses": responses, "pinned": pinned, "anthropic": anthropic,
           "speculative": speculative, "stream_drop": stream_drop, "request_drop": request_drop}


def worker(base: str, w: int, ledger: Ledger, stop: threading.Event, quota: int | None, timeout: float) -> None:
    i = 0
    with httpx.Client(base_url=base, timeout=timeout) as c:
        while not stop.is_set() and (quota is None or i < quota):
            kind = KINDS[(w + i) % len(KINDS)]
            start = time.monotonic()
            try:
                ACTIONS[kind](c, w, i)
                ledger.record(kind, start, None)
            except (httpx.HTTPError, RuntimeError, ValueError, KeyError) as err:
                ledger.record(kind, start, f"{type(err).__name__}: {err}")
                wait_healthy(base, timeout)  # as a client backs off: not a burst of errors while the engine restarts
            i += 1


def wait_healthy(base: str, deadline_s: float) -> bool:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        try:
            if httpx.get(f"{base}/health", timeout=5).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    return False


def restarts_now(base: str) -> int:
    """The supervisor's restart count, as /health reports it (in its 200 and its 503 bodies)."""
    try:
        return int(httpx.get(f"{base}/health", timeout=5).json().get("restarts", -1))
    except (httpx.HTTPError, ValueError):
        return -1


def probe(base: str) -> str:
    r = httpx.post(f"{base}/v1/completions", json={"model": "soak", "prompt": PROBE, "max_tokens": 32, "temperature": 0}, timeout=300)
    return _check(r)["choices"][0]["text"]


class Chaos:
    """Resizes and kills, by the clock or by completed units."""

    def __init__(self, server: soak.Server, ledger: Ledger, args: argparse.Namespace, samples: list[dict[str, Any]], t0: float) -> None:
        self.server, self.ledger, self.args, self.samples, self.t0 = server, ledger, args, samples, t0
        status = httpx.get(f"{server.base}/v1/cache/status", timeout=60).json()
        self.pools = {name: int(p["capacity"]) for name, p in status["pools"].items()}
        self.page = int(status.get("page_size") or 1)
        self.small = False

    def resize(self) -> None:
        self.small = not self.small
        body = {}
        for name, key in (("full", "full_tokens"), ("swa", "swa_tokens")):
            if name in self.pools:
                pages = self.pools[name] * 3 // 4 if self.small and name == "full" else self.pools[name]
                if name == "swa" and self.small:
                    pages = self.pools[name] + max(1, self.pools[name] // 4)  # the SWA pool sits at its floor: grow it instead
                body[key] = pages * self.page
        if "state" in self.pools:  # a hybrid's state pool: a quarter of it (snapshots) goes and comes back
            slots = self.pools["state"]
            body["state_slots"] = slots - slots // 4 if self.small else slots
        r = httpx.post(f"{self.server.base}/admin/cache/resize", json=body, timeout=120)
        with self.ledger.lock:
            if r.status_code == 200:
                self.ledger.resizes["applied"] += 1
            elif r.status_code == 409:
                self.ledger.resizes["refused_409"] += 1
            else:
                self.ledger.errors.append({"kind": "resize", "start": 0.0, "end": 0.0, "message": f"HTTP {r.status_code} {r.text[:300]}"})

    def kill(self) -> None:
        self.samples.append(soak_sample(self.server, self.t0, self.ledger))  # the engine's counters die with it
        pids = [p.pid for p in self.server.engine_processes()]
        before = restarts_now(self.server.base)
        with self.ledger.lock:
            self.ledger.kills.append([time.monotonic(), float("inf")])
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        # the window closes once the supervisor has restarted the engine and /health is 200 again
        end = time.monotonic() + self.args.ready_timeout
        while restarts_now(self.server.base) <= before and time.monotonic() < end:
            time.sleep(0.2)
        healthy = wait_healthy(self.server.base, self.args.ready_timeout)
        with self.ledger.lock:
            self.ledger.kills[-1][1] = time.monotonic()
        if not healthy:
            raise SystemExit("chaos: ft serve did not come back after a kill")

    def run(self, stop: threading.Event) -> None:
        a = self.args
        if a.requests is None:
            kill_at = [a.duration * (k + 1) / (a.kills + 1) for k in range(a.kills)]
            next_resize = a.resize_every
            while not stop.wait(0.5):
                now = time.monotonic() - self.t0
                if kill_at and now >= kill_at[0]:
                    kill_at.pop(0)
                    self.kill()
                elif now >= next_resize:
                    next_resize = now + a.resize_every
                    self.resize()
            return
        kill_at = [a.requests * (k + 1) // (a.kills + 1) for k in range(a.kills)]
        next_resize = a.resize_every_requests
        while not stop.is_set():
            with self.ledger.lock:
                target = min([*kill_at[:1], next_resize])
                self.ledger.changed.wait_for(lambda: self.ledger.units >= target or stop.is_set(), timeout=a.request_timeout)
                units = self.ledger.units
            if stop.is_set():
                return
            if kill_at and units >= kill_at[0]:
                kill_at.pop(0)
                self.kill()
            if units >= next_resize:
                next_resize = units + a.resize_every_requests
                self.resize()


def soak_sample(server: soak.Server, t0: float, ledger: Ledger) -> dict[str, Any]:
    totals = soak.Totals()
    with ledger.lock:
        totals.requests = sum(ledger.done.values())
        totals.errors = [e["message"] for e in ledger.errors]
    return soak.sample(server, t0, totals)


def verdict(samples: list[dict[str, Any]], idle: dict[str, Any], ledger: Ledger, probes: tuple[str, str],
            restarts: int) -> list[str]:
    failures = [f"unexpected error ({e['kind']}): {e['message']}" for e in ledger.unexpected()[:5]]
    if any(s["violations"] or s["quarantined_pages"] for s in samples):
        failures.append("audit violations or quarantined pages in a sample")
    if restarts != len(ledger.kills):
        failures.append(f"engine restarts {restarts} != kills {len(ledger.kills)}")
    for name, pool in idle["pools"].items():
        if pool["in_use"] or pool["capacity"] != pool["free"] + pool["cached"] + pool["in_use"] + pool["quarantined"]:
            failures.append(f"pool {name} unbalanced at idle: {pool}")
    failures += [f"no {kind} unit succeeded" for kind, n in ledger.done.items() if n == 0]
    if probes[0] != probes[1]:
        failures.append(f"greedy probe changed: {probes[0]!r} -> {probes[1]!r}")
    return failures


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="what `ft serve --model` gets (default: the bundled Gemma 3 270M)")
    p.add_argument("--duration", type=float, default=1800.0, help="seconds of traffic (default 1800)")
    p.add_argument("--requests", type=int, default=None, help="instead of --duration: exactly this many traffic units (no clock; tests)")
    p.add_argument("--workers", type=int, default=4, help="traffic threads, also --max-running-requests (default 4)")
    p.add_argument("--kills", type=int, default=2, help="engine SIGKILLs, spread over the run (default 2)")
    p.add_argument("--resize-every", type=float, default=20.0, help="seconds between pool resizes (default 20)")
    p.add_argument("--resize-every-requests", type=int, default=10, help="with --requests: units between resizes (default 10)")
    p.add_argument("--interval", type=float, default=5.0, help="seconds between samples (default 5)")
    p.add_argument("--threads", type=int, default=None, help="ft serve --threads")
    p.add_argument("--port", type=int, default=None)
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--ready-timeout", type=float, default=600.0)
    p.add_argument("--serve-arg", action="append", default=[], metavar="ARG", help="an extra `ft serve` argument (repeatable)")
    p.add_argument("--out", type=Path, default=Path("bench-out/chaos"))
    p.add_argument("--hybrid", action="store_true",
                   help="a hybrid model (Qwen3.5): no --speculative (refused), no --swa-pool-tokens (no SWA pool)")
    args = p.parse_args(argv)
    # what soak.Server reads
    args.conversations = args.workers
    features = ["--kv-cache-dtype", "int8"] if args.hybrid else ["--speculative", "ngram", "--kv-cache-dtype", "int8", "--swa-pool-tokens", "floor"]
    args.serve_arg = [*features, "--debug-kv", *args.serve_arg]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, soak._interrupt)
    args.out.mkdir(parents=True, exist_ok=True)
    server = soak.Server(args, args.out)
    print(f"chaos: {' '.join(server.cmd)}", flush=True)
    ledger, stop, samples = Ledger(), threading.Event(), []
    probes = ("", "")
    restarts, code = -1, -1
    idle: dict[str, Any] = {"pools": {}}
    try:
        server.wait_healthy(args.ready_timeout)
        first_probe = probe(server.base)
        t0 = time.monotonic()
        chaos = Chaos(server, ledger, args, samples, t0)
        quota = None if args.requests is None else -(-args.requests // args.workers)
        workers = [threading.Thread(target=worker, args=(server.base, w, ledger, stop, quota, args.request_timeout), daemon=True)
                   for w in range(args.workers)]
        for w in workers:
            w.start()
        chaos_thread = threading.Thread(target=chaos.run, args=(stop,), daemon=True)
        chaos_thread.start()
        while any(w.is_alive() for w in workers):
            if args.requests is None and time.monotonic() - t0 >= args.duration:
                break
            try:
                samples.append(soak_sample(server, t0, ledger))
            except (httpx.HTTPError, KeyError, ValueError):
                pass  # the engine is being killed or restarted: no status to read now
            for w in workers:
                w.join(timeout=args.interval / len(workers))
        stop.set()
        with ledger.lock:
            ledger.changed.notify_all()
        for w in workers:
            w.join(args.request_timeout)
        chaos_thread.join(args.ready_timeout)
        idle = soak.wait_idle(server)
        samples.append(soak_sample(server, t0, ledger))
        restarts = int(idle["engine"]["restarts"])
        probes = (first_probe, probe(server.base))
    finally:
        stop.set()
        code = server.stop()
    failures = verdict(samples, idle, ledger, probes, restarts)
    if code != 0:
        failures.append(f"ft serve exited with {code} on SIGTERM (expected 0 after a drain)")
    with open(args.out / "chaos.csv", "w", newline="") as f:
        if samples:
            writer = csv.DictWriter(f, fieldnames=list(samples[0]))
            writer.writeheader()
            writer.writerows(samples)
    expected = len(ledger.errors) - len(ledger.unexpected())
    summary = {
        "duration_s": args.duration if args.requests is None else None, "requests": args.requests, "workers": args.workers,
        "done": ledger.done, "units": ledger.units, "expected_errors": expected, "unexpected_errors": len(ledger.unexpected()),
        "kills": len(ledger.kills), "restarts": restarts, "resizes": ledger.resizes, "probes": probes,
        "rss_total_mb_first": samples[0]["rss_total_mb"] if samples else None,
        "rss_total_mb_max": max((s["rss_total_mb"] for s in samples), default=None),
        "rss_total_mb_last": samples[-1]["rss_total_mb"] if samples else None,
        "audits": max((s["audits"] for s in samples), default=0), "samples": len(samples), "idle_pools": idle["pools"],
        "serve_command": " ".join(server.cmd), "serve_exit_code": code, "passed": not failures, "failures": failures,
    }
    (args.out / "chaos.json").write_text(json.dumps(summary, indent=2))
    soak.plot(samples, args.out / "chaos.png", 0.0)
    print(json.dumps(summary, indent=1))
    for reason in failures:
        print(f"chaos: FAILED: {reason}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
