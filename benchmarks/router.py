"""FreeToken replicas behind a cache-aware router (sglang-router or vllm-router), on one machine.

    python benchmarks/router.py --model gemma3-270m [--router sglang|vllm] [--conversations 4]
                                [--turns 4] [--out r.json]

Starts two `ft serve` replicas (`--threads 1` each, cache report on) and the router on 127.0.0.1,
then runs multi-turn agent conversations through it (a shared system prompt, each turn a
streamed greedy reply and a tool result sent back: benchmarks/serving.py's agent workload, with
fresh text per phase so no phase hits what an earlier one cached), in four phases:

- cache_aware: the router's `--policy cache_aware`. Reported: the overall hit rate (cached /
  prompt tokens), and for later turns the share that landed on the replica of the turn before
  and the share with cached tokens > 0.
- round_robin: the same workload through a second router with `--policy round_robin` over the
  same replicas, for the hit rate beside cache_aware.
- drain: cache-aware again; after a few requests, `POST /admin/drain` to the busiest replica. It
  must leave the pool without a failed request (its in-flight requests finish, new ones go to
  the other replica, and it exits).
- kill: a fresh replica takes the drained one's place; after a few requests the busiest replica
  gets SIGKILL (its whole process group). Only requests in flight at that moment may fail; every
  request sent after it must be served by the other replica.

Each request's replica is the `x-freetoken-replica` response header. Owns the processes, the
phases and their figures; request text and SSE parsing come from benchmarks/serving.py. Nothing
is timed for a claim (the wall times are context); run it on the tiny models in tests/ or on a
bundled model.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from freetoken.utils.ports import free_port


def _sibling(name: str) -> Any:
    """A sibling script loaded by path as `bench_<name>` (as benchmarks/peer.py does)."""
    key = f"bench_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, Path(__file__).resolve().parent / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        spec.loader.exec_module(module)
    return sys.modules[key]


serving = _sibling("serving")

REPLICA_HEADER = "x-freetoken-replica"
READY_DEADLINE_S = 600.0
ROUTERS = ("sglang", "vllm")
# Fast failure detection and retries that outlast it, so a request sent to a replica that just
# died or is draining is retried on the other one (both routers take these flags).
ROUTER_FLAGS = [
    "--health-check-interval-secs", "1", "--health-failure-threshold", "1", "--health-success-threshold", "1",
    "--worker-startup-check-interval", "1", "--retry-max-retries", "10", "--retry-initial-backoff-ms", "100",
    "--retry-max-backoff-ms", "1000",
]
LOG_LEVEL = {"sglang": "warn", "vllm": "warning"}


@dataclass(frozen=True)
class Settings:
    model: str
    router: str = "sglang"
    conversations: int = 4
    turns: int = 4
    reply_tokens: int = 16
    system_words: int = 60
    session_header: bool = False  # send `x-session-id: <conversation>` (vllm-router keys chat affinity on it)
    act_after: int = 3  # requests finished in a drain / kill phase before the drain or the kill
    serve_flags: tuple[str, ...] = ()
    log_dir: str = "bench-out/router-logs"


class Proc:
    """A child process in its own session (a kill reaches the engine process too), logged to a file."""

    def __init__(self, name: str, cmd: list[str], log_dir: Path) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()
        self._log.close()


def wait_for(proc: Proc, url: str, ok: Any, deadline_s: float = READY_DEADLINE_S) -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if proc.proc.poll() is not None:
            raise RuntimeError(f"{proc.name} exited with {proc.proc.returncode}:\n{proc.log_tail()}")
        try:
            r = httpx.get(url, timeout=5)
            if r.status_code == 200 and ok(r):
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"{proc.name} not ready in {deadline_s} s:\n{proc.log_tail()}")


def replica_id(url: str) -> str:
    """The `x-freetoken-replica` value of the replica at `url` (this host's name and its port)."""
    return f"{socket.gethostname()}:{url.rsplit(':', 1)[1]}"


def start_replica(s: Settings, name: str, log_dir: Path) -> tuple[Proc, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "freetoken.cli", "serve", "--model", s.model, "--host", "127.0.0.1", "--port", str(port),
           "--threads", "1", "--enable-cache-report", *s.serve_flags]
    proc = Proc(name, cmd, log_dir)
    return proc, f"http://127.0.0.1:{port}"


def router_command(kind: str, port: int, policy: str, workers: list[str]) -> list[str]:
    common = ["--host", "127.0.0.1", "--port", str(port), "--worker-urls", *workers, "--policy", policy,
              "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()), *ROUTER_FLAGS, "--log-level", LOG_LEVEL[kind]]
    if kind == "sglang":
        return [sys.executable, "-m", "sglang_router.launch_router", *common]
    exe = shutil.which("vllm-router")
    return [exe, *common] if exe else [sys.executable, "-m", "vllm_router.launch_router", *common]


def start_router(s: Settings, policy: str, workers: list[str], log_dir: Path, tag: str) -> tuple[Proc, str]:
    port = free_port()
    proc = Proc(f"router-{tag}", router_command(s.router, port, policy, workers), log_dir)
    base = f"http://127.0.0.1:{port}"
    wait_for(proc, f"{base}/readiness", lambda r: r.json().get("healthy_workers") == len(workers), 120.0)
    return proc, base


# ---- the workload ----

@dataclass
class Turn:
    """One request as the client saw it (perf_counter seconds)."""

    phase: str
    conv: int
    turn: int
    start: float
    end: float = 0.0
    replica: str | None = None
    status: int | None = None  # the HTTP status (None: no response)
    ok: bool = False
    error: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0


async def chat_turn(
    http: httpx.AsyncClient, turn: Turn, messages: list[dict[str, Any]], max_tokens: int, headers: dict[str, str],
    extra: dict[str, Any],
) -> str:
    """Stream one chat turn into `turn`; returns the reply text ("" when it failed)."""
    body = {**extra, "model": "default", "messages": messages, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    out = serving.Stream(start=turn.start)
    done = False
    try:
        async with http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
            turn.replica, turn.status = r.headers.get(REPLICA_HEADER), r.status_code
            if r.status_code != 200:
                turn.error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:200]}"
            else:
                async for line in r.aiter_lines():
                    if line.startswith("data:") and line[5:].strip() == "[DONE]":
                        done = True
                        break
                    if line.startswith("data:"):
                        serving.add_event(out, json.loads(line[5:]), time.perf_counter())
                turn.error = None if done else "the stream ended without [DONE]"
    except (httpx.HTTPError, serving.BenchError) as err:
        turn.error = f"{type(err).__name__}: {err}"
    turn.end = time.perf_counter()
    turn.ok = turn.error is None
    turn.prompt_tokens, turn.cached_tokens = out.prompt_tokens, out.cached_tokens or 0
    return out.text if turn.ok else ""


async def conversations(s: Settings, base: str, phase: str, turns: list[Turn], on_done: Any = None) -> None:
    """`s.conversations` concurrent conversations of `s.turns` turns over one shared system prompt.
    A turn that failed without a 4xx is sent again (as a user would), at most twice."""
    system = "You are a coding agent. Follow the project notes below.\n" + serving.words_text(zlib.crc32(phase.encode()), s.system_words)

    async def one(k: int, http: httpx.AsyncClient) -> None:
        rng = random.Random(f"{phase}-{k}")
        headers = {"x-session-id": f"{phase}-{k}"} if s.session_header else {}
        extra = {"session_params": {"session_id": f"{phase}-{k}"}} if s.session_header else {}
        messages = [{"role": "system", "content": system},
                    {"role": "user", "content": f"Task {phase}.{k}: find where the {rng.choice(serving.WORDS)} is handled."}]
        for t in range(s.turns):
            for _ in range(3):
                turn = Turn(phase, k, t, time.perf_counter())
                turns.append(turn)
                text = await chat_turn(http, turn, messages, s.reply_tokens, headers, extra)
                if on_done is not None:
                    on_done()
                if turn.ok or (turn.status is not None and 400 <= turn.status < 500):
                    break
            messages = [*messages, {"role": "assistant", "content": text or "(no text)"},
                        {"role": "user", "content": serving.tool_result(rng)}]

    async with httpx.AsyncClient(base_url=base, timeout=httpx.Timeout(600.0)) as http:
        await asyncio.gather(*(one(k, http) for k in range(s.conversations)))


def figures(turns: list[Turn]) -> dict[str, Any]:
    """Hit rate over served requests; for later turns, stickiness (same replica as the turn
    before in that conversation) and the share with a cache hit."""
    served = [t for t in turns if t.ok]
    prompt = sum(t.prompt_tokens for t in served)
    last: dict[int, str | None] = {}
    later = sticky = hits = 0
    for t in sorted(served, key=lambda x: (x.conv, x.turn, x.start)):
        if t.turn > 0:
            later += 1
            sticky += t.replica == last.get(t.conv)
            hits += t.cached_tokens > 0
        last[t.conv] = t.replica
    per_replica: dict[str, int] = {}
    for t in served:
        per_replica[str(t.replica)] = per_replica.get(str(t.replica), 0) + 1
    return {
        "requests": len(turns), "served": len(served), "failed": len(turns) - len(served),
        "prompt_tokens": prompt, "cached_tokens": sum(t.cached_tokens for t in served),
        "hit_rate": sum(t.cached_tokens for t in served) / prompt if prompt else None,
        "later_turns": later, "later_sticky_share": sticky / later if later else None,
        "later_hit_share": hits / later if later else None, "per_replica": per_replica,
    }


def busiest(turns: list[Turn], replicas: dict[str, str]) -> str:
    """The replica (name) that served the most requests so far."""
    counts = {name: sum(t.ok and t.replica == replica_id(url) for t in turns) for name, url in replicas.items()}
    return max(counts, key=lambda n: counts[n])


async def disruption(s: Settings, base: str, phase: str, act: Any) -> tuple[list[Turn], float, float]:
    """Run the workload; after `s.act_after` requests finished, call `act(turns)` once (drain or
    kill). Returns the requests, when `act` was called and when it returned."""
    turns: list[Turn] = []
    fired = asyncio.Event()
    when: list[float] = []

    def on_done() -> None:
        if not fired.is_set() and sum(t.end > 0 for t in turns) >= s.act_after:
            fired.set()

    async def actor() -> None:
        await fired.wait()
        when.append(time.perf_counter())
        await asyncio.to_thread(act, turns)
        when.append(time.perf_counter())  # a request sent from here on must avoid the replica

    await asyncio.gather(conversations(s, base, phase, turns, on_done), actor())
    return turns, when[0], when[1]


def run(s: Settings) -> dict[str, Any]:
    log_dir = Path(s.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    procs: dict[str, Proc] = {}
    urls: dict[str, str] = {}
    result: dict[str, Any] = {"settings": asdict(s), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    try:
        for name in ("a", "b"):
            procs[name], urls[name] = start_replica(s, f"replica-{name}", log_dir)
        for name in ("a", "b"):
            wait_for(procs[name], f"{urls[name]}/health", lambda r: True)
        for policy in ("cache_aware", "round_robin"):
            router, base = start_router(s, policy, [urls["a"], urls["b"]], log_dir, policy)
            turns: list[Turn] = []
            t0 = time.perf_counter()
            asyncio.run(conversations(s, base, policy, turns))
            result[policy] = {**figures(turns), "wall_s": time.perf_counter() - t0, "turns": [asdict(t) for t in turns]}
            router.stop()

        router, base = start_router(s, "cache_aware", [urls["a"], urls["b"]], log_dir, "drain")
        target: list[str] = []

        def drain(turns: list[Turn]) -> None:
            target.append(busiest(turns, {"a": urls["a"], "b": urls["b"]}))
            httpx.post(f"{urls[target[0]]}/admin/drain", timeout=30).raise_for_status()

        turns, _, t_drain = asyncio.run(disruption(s, base, "drain", drain))
        exit_code = procs[target[0]].proc.wait(timeout=120)
        after = [t for t in turns if t.start > t_drain]
        result["drain"] = {**figures(turns), "drained": target[0], "drained_exit_code": exit_code,
                           "sent_after_drain": len(after),
                           "served_after_drain_by_drained": sum(t.ok and t.replica == replica_id(urls[target[0]]) for t in after),
                           "turns": [asdict(t) for t in turns]}
        router.stop()
        procs[target[0]].stop()

        survivor = "b" if target[0] == "a" else "a"
        procs["c"], urls["c"] = start_replica(s, "replica-c", log_dir)
        wait_for(procs["c"], f"{urls['c']}/health", lambda r: True)
        pool = {survivor: urls[survivor], "c": urls["c"]}
        router, base = start_router(s, "cache_aware", list(pool.values()), log_dir, "kill")
        killed: list[str] = []

        def kill(turns: list[Turn]) -> None:
            killed.append(busiest(turns, pool))
            procs[killed[0]].kill()

        turns, t_called, t_kill = asyncio.run(disruption(s, base, "kill", kill))
        in_flight = [t for t in turns if t.start < t_kill and t.end > t_called]
        after = [t for t in turns if t.start > t_kill]
        failed = [t for t in turns if not t.ok]
        result["kill"] = {
            **figures(turns), "killed": killed[0], "in_flight_at_kill": len(in_flight),
            "failed_in_flight_at_kill": sum(t in in_flight for t in failed),
            "failed_sent_after_kill": sum(not t.ok for t in after), "sent_after_kill": len(after),
            "served_after_kill_by_killed": sum(t.ok and t.replica == replica_id(pool[killed[0]]) for t in after),
            "turns": [asdict(t) for t in turns],
        }
        router.stop()
    finally:
        for proc in procs.values():
            proc.stop()
    result["replicas"] = {name: {"url": url, "id": replica_id(url)} for name, url in urls.items()}
    return result


def summary(r: dict[str, Any]) -> str:
    def pct(x: float | None) -> str:
        return "-" if x is None else f"{100 * x:.0f}%"

    lines = [f"## {r['settings']['router']}-router, model {r['settings']['model']}", "",
             "| phase | requests | failed | hit rate | later turns: same replica / cached > 0 | per replica |", "|---|---|---|---|---|---|"]
    for phase in ("cache_aware", "round_robin", "drain", "kill"):
        p = r[phase]
        lines.append(f"| {phase} | {p['requests']} | {p['failed']} | {pct(p['hit_rate'])} | "
                     f"{pct(p['later_sticky_share'])} / {pct(p['later_hit_share'])} | {p['per_replica']} |")
    d, k = r["drain"], r["kill"]
    drained = (f"drain: replica {d['drained']} drained, exit code {d['drained_exit_code']}, {d['failed']} failed, "
               f"{d['sent_after_drain']} sent after the drain ({d['served_after_drain_by_drained']} served by the drained one)")
    killed = (f"kill: replica {k['killed']} killed with {k['in_flight_at_kill']} requests in flight; failed: "
              f"{k['failed_in_flight_at_kill']} of those, {k['failed_sent_after_kill']} of the {k['sent_after_kill']} sent after "
              f"({k['served_after_kill_by_killed']} served by the killed one)")
    lines += ["", drained, killed]
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="what `ft serve --model` takes")
    p.add_argument("--router", choices=ROUTERS, default="sglang")
    p.add_argument("--conversations", type=int, default=4)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--reply-tokens", type=int, default=16)
    p.add_argument("--system-words", type=int, default=60)
    p.add_argument("--session-header", action="store_true", help="send x-session-id per conversation")
    p.add_argument("--serve-flag", action="append", default=[], help="an extra `ft serve` flag (repeat; e.g. --serve-flag=--dtype=float32)")
    p.add_argument("--log-dir", default="bench-out/router-logs")
    p.add_argument("--out", help="write the result JSON here")
    a = p.parse_args(argv)
    s = Settings(model=a.model, router=a.router, conversations=a.conversations, turns=a.turns, reply_tokens=a.reply_tokens,
                 system_words=a.system_words, session_header=a.session_header, serve_flags=tuple(a.serve_flag), log_dir=a.log_dir)
    result = run(s)
    print(summary(result))
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
