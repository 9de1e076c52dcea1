"""Cached share of the agent workload per turn, FreeToken beside llama-server (issue 27).

    python benchmarks/agent_cache.py --model ~/.cache/freetoken/models/qwen35moe-Q4_K_M.gguf
        [--conversations 4 8] [--slots 4] [--turns 4] [--threads 2] [--paired-rounds 3] [--out-dir bench-out/agent]

Starts both servers at once (benchmarks/peer.py's commands: llama-server `-np SLOTS`, `ft serve
--max-running-requests SLOTS`, the same KV capacity, SLOTS x `--slot-ctx` tokens), then for each
conversation count runs the workload against one server, then the other (the order swapped each
time; the idle one waits): C conversations at once over one shared ~1,200-word system prompt, each
opening with a one-line task; every turn is a streamed chat request of the conversation so far,
then the reply and a tool result (`freetoken.bench.serving.tool_result`, ~100 words) are appended,
so each request extends the last. A conversation sends its next turn as soon as its reply is in:
with more conversations than slots they queue. Each conversation count after the first tags its
conversations' tasks (and their tool results' seeds) so that none repeats a conversation of an
earlier count, whose turns the servers still hold.

The cached share is what each server reports per request (FreeToken: `usage.prompt_tokens_details.
cached_tokens`; llama-server: `timings.cache_n`, beside `usage.prompt_tokens`), summed per turn;
the figure the issue names is turns 2..T together. These are counts, not timings, so a busy machine
does not move them (only which requests happen to run together, as on any server). With
`--paired-rounds R` the single-stream decode and a cold prefill are then measured in R alternating
rounds (freetoken.bench.paired), whose per-round ratios cancel the shared machine's drift.

Writes `agent-cache.json` and `agent-cache.md` into `--out-dir`.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import peer

from freetoken.bench import paired, serving
from freetoken.utils.ports import free_port


@dataclasses.dataclass
class Turn:
    conversation: int
    turn: int
    prompt_tokens: int = 0
    cached_tokens: int | None = None  # as the usage reports it
    cache_n: int | None = None  # llama-server's timings
    prompt_n: int | None = None
    completion_tokens: int = 0
    latency_s: float = 0.0


async def chat(
    http: httpx.AsyncClient, model: str, messages: list[dict[str, Any]], reply_tokens: int, turn: Turn
) -> str:
    body = {"model": model, "messages": messages, "max_tokens": reply_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    out = serving.Stream(start=time.perf_counter())
    async with http.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise serving.BenchError(f"HTTP {r.status_code}: {(await r.aread()).decode()[:300]}")
        async for line in r.aiter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            event = json.loads(line[5:])
            serving.add_event(out, event, time.perf_counter())
            timings = event.get("timings")
            if timings:
                turn.cache_n, turn.prompt_n = timings.get("cache_n"), timings.get("prompt_n")
            usage = event.get("usage")
            if usage:
                turn.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    turn.prompt_tokens, turn.completion_tokens = out.prompt_tokens, out.completion_tokens
    turn.latency_s = time.perf_counter() - out.start
    return out.text


async def workload(
    base: str, conversations: int, turns: int, reply_tokens: int, system_words: int, tag: str = ""
) -> list[Turn]:
    system = "You are a coding agent. Follow the project notes below.\n" + serving.words_text(7, system_words)
    done: list[Turn] = []
    async with httpx.AsyncClient(base_url=base, timeout=httpx.Timeout(3600.0)) as http:
        model = (await http.get("/v1/models")).json()["data"][0]["id"]

        async def conversation(k: int) -> None:
            rng = random.Random(f"{tag}{k}" if tag else k)
            task = f"Task {tag}{k}: find where the {rng.choice(serving.WORDS)} {rng.choice(serving.WORDS)} is handled."
            messages = [{"role": "system", "content": system}, {"role": "user", "content": task}]
            for t in range(turns):
                turn = Turn(k, t + 1)
                text = await chat(http, model, messages, reply_tokens, turn)
                done.append(turn)
                print(f"  conv {k} turn {t + 1}: prompt {turn.prompt_tokens}, cached {cached(turn)}, "
                      f"{turn.latency_s:.1f} s", file=sys.stderr, flush=True)  # fmt: skip
                tool = {"role": "user", "content": serving.tool_result(rng)}
                messages = [*messages, {"role": "assistant", "content": text or "(no text)"}, tool]

        await asyncio.gather(*(conversation(k) for k in range(conversations)))
    return done


def cached(t: Turn) -> int:
    """The usage's cached tokens, else llama-server's timings.cache_n."""
    if t.cached_tokens is not None:
        return t.cached_tokens
    return t.cache_n or 0


def shares(turns: list[Turn], last: int) -> dict[str, Any]:
    per_turn = {}
    for k in range(1, last + 1):
        ts = [t for t in turns if t.turn == k]
        p, c = sum(t.prompt_tokens for t in ts), sum(cached(t) for t in ts)
        per_turn[k] = {"prompt_tokens": p, "cached_tokens": c, "share": c / p if p else None}
    later = [t for t in turns if t.turn >= 2]
    p, c = sum(t.prompt_tokens for t in later), sum(cached(t) for t in later)
    return {"per_turn": per_turn, "turns_2_on": {"prompt_tokens": p, "cached_tokens": c, "share": c / p if p else None},
            "latency_s_p50": serving.percentile([t.latency_s for t in turns], 50)}  # fmt: skip


def table(results: dict[int, dict[str, Any]], turns: int) -> str:
    lines = ["| conversations / slots | server | " + " | ".join(f"turn {k}" for k in range(1, turns + 1))
             + " | turns 2-" + str(turns) + " |", "|---" * (turns + 3) + "|"]  # fmt: skip
    for c, by_server in results.items():
        for server, r in by_server.items():
            cells = [f"{100 * v['share']:.1f}%" if v["share"] is not None else "-" for v in r["per_turn"].values()]
            later = r["turns_2_on"]
            lines.append(f"| {c} / {r['slots']} | {server} | " + " | ".join(cells)
                         + f" | **{100 * later['share']:.1f}%** ({later['cached_tokens']}/{later['prompt_tokens']}) |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="a .gguf path")
    p.add_argument("--conversations", type=int, nargs="*", default=[4, 8], help="none: only the paired rounds")
    p.add_argument("--slots", type=int, default=4, help="llama-server -np, ft serve --max-running-requests")
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--reply-tokens", type=int, default=24)
    p.add_argument("--system-words", type=int, default=1200)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--slot-ctx", type=int, default=8192, help="KV tokens per slot; both servers get slots x this")
    p.add_argument("--llama-server", type=Path, default=peer.DEFAULT_CACHE / "build" / "bin" / "llama-server")
    p.add_argument("--llama-args", default="")
    p.add_argument("--ft-args", default="")
    p.add_argument("--servers", nargs="+", choices=["llama-server", "freetoken"], default=["llama-server", "freetoken"])
    p.add_argument("--paired-rounds", type=int, default=0, metavar="R")
    p.add_argument("--start-timeout", type=float, default=900.0)
    p.add_argument("--out-dir", type=Path, default=Path("bench-out/agent"))
    a = p.parse_args(argv)
    a.out_dir.mkdir(parents=True, exist_ok=True)
    ports = {name: free_port() for name in a.servers}
    kv = a.slots * a.slot_ctx
    cmds = {"llama-server": peer.llama_cmd(a.llama_server, a.model, a.threads, a.slots, a.slot_ctx,
                                           ports.get("llama-server", 0), a.llama_args),
            "freetoken": peer.ft_cmd(a.model, a.threads, kv, ports.get("freetoken", 0),
                                     f"--max-running-requests {a.slots} {a.ft_args}")}  # fmt: skip
    procs = {name: peer.ServerProcess(cmds[name], ports[name], a.out_dir / f"{name}.log") for name in a.servers}
    out: dict[str, Any] = {"model": a.model, "threads": a.threads, "slots": a.slots, "turns": a.turns,
                           "reply_tokens": a.reply_tokens, "system_words": a.system_words, "cpus": os.cpu_count(),
                           "commands": {n: " ".join(cmds[n]) for n in a.servers}, "runs": {}}  # fmt: skip
    try:
        for proc in procs.values():
            proc.wait_healthy(a.start_timeout)
        for i, c in enumerate(a.conversations):
            order = a.servers if i % 2 == 0 else a.servers[::-1]
            out["runs"][c] = {}
            for name in order:
                load = os.getloadavg()
                print(f"== {name}: {c} conversations on {a.slots} slots (load {load[0]:.2f})", file=sys.stderr)
                t0 = time.perf_counter()
                tag = (
                    f"{c}." if i else ""
                )  # no conversation repeats an earlier run's (its turns would hit that run's cache)
                turns = asyncio.run(workload(procs[name].base_url, c, a.turns, a.reply_tokens, a.system_words, tag))
                out["runs"][c][name] = {"slots": a.slots, "wall_s": time.perf_counter() - t0, "load_at_start": load,
                                        **shares(turns, a.turns), "turns": [dataclasses.asdict(t) for t in turns]}  # fmt: skip
                (a.out_dir / "agent-cache.json").write_text(json.dumps(out, indent=1))
        md = table(out["runs"], a.turns)
        if a.paired_rounds:
            settings = serving.Settings(base_url="", decode_tokens=32, repeats=2, prefill_lengths=(512,),
                                        prefill_repeats=1, progress=False)  # fmt: skip
            rounds = paired.run_rounds({n: procs[n].base_url for n in a.servers}, a.paired_rounds, settings)
            out["paired_rounds"] = rounds
            md += "\n\n" + paired.paired_table(rounds, "freetoken", "llama-server")
        out["load_at_end"] = os.getloadavg()
        out["peak_rss_mb"] = {n: procs[n].peak_rss / 2**20 for n in a.servers}
        (a.out_dir / "agent-cache.json").write_text(json.dumps(out, indent=1))
        (a.out_dir / "agent-cache.md").write_text(md + "\n")
        print(md)
    finally:
        for proc in procs.values():
            proc.stop()


if __name__ == "__main__":
    main(sys.argv[1:])
