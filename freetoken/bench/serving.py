"""A serving benchmark for any OpenAI-compatible server (`ft serve`, llama.cpp's `llama-server`).

    ft bench serve --base-url http://127.0.0.1:1919 [--out r.json] [--plot r.png] [--quick]
    ft bench serve --base-url URL --peer-url URL --paired-rounds 5   # see freetoken/bench/paired.py
    python benchmarks/serving.py plot a.json b.json --out both.png

Owns the four scenarios, their statistics, the result JSON and the plot; it starts no server
(benchmarks/peer.py does) and sends only standard OpenAI fields plus `ignore_eos`, which both
servers accept (FreeToken refuses unknown fields, so no `n_predict` or `cache_prompt`).

- single: one stream at a time, greedy and `temperature 0.8, top_p 0.95`, EOS ignored; decode
  rate = tokens after the first / time after the first, median over repeats.
- sweep: 1, 2, 4, 8, 16 concurrent streams; total generated tokens/s over the wall time, and the
  median per-stream decode rate.
- prefill: time to first token of distinct prompts (a random head, so no prefix-cache hit) of
  512 / 1024 / 2048 tokens, counted with the server's own tokenize endpoint.
- agent: N conversations over one shared ~1,200-word system prompt, each turn a 24-token
  streamed chat reply followed by a tool result sent back, for a fixed duration.

Token times are the arrival times of streamed chunks carrying text; a server that packs several
tokens into one chunk makes inter-token latency coarser, never the decode rate (counted from
`usage.completion_tokens`).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from tqdm import tqdm

try:
    import httpx
except ImportError:  # pragma: no cover - the [bench] / [test] extras install it
    raise SystemExit("ft bench serve needs httpx: pip install -e '.[bench]'") from None

SCENARIOS = ("single", "sweep", "prefill", "agent")
WORDS = (
    "system request answer tool search file read write model token page cache memory window "
    "thread batch queue server client stream value table index record field error result plan "
    "step check test build run code line function class module package option config default "
    "user agent message reply history context prompt output input number string list object "
    "time date city river mountain forest ocean market garden library station bridge tower "
    "green blue quiet quick bright heavy simple careful early late small large open closed"
).split()


class BenchError(RuntimeError):
    """A request failed (HTTP status, stream error event): a run with errors is not a result."""


@dataclass(frozen=True)
class Settings:
    base_url: str
    model: str | None = None
    api_key: str | None = None
    label: str | None = None
    scenarios: tuple[str, ...] = SCENARIOS
    decode_tokens: int = 64
    repeats: int = 5
    concurrency: tuple[int, ...] = (1, 2, 4, 8, 16)
    sweep_rounds: int = 2  # requests each concurrent stream sends back to back
    prefill_lengths: tuple[int, ...] = (512, 1024, 2048)
    prefill_repeats: int = 3
    agent_conversations: int = 4
    agent_duration_s: float = 120.0
    agent_reply_tokens: int = 24
    agent_turns: int = 6  # turns before a conversation starts over with a new task
    system_words: int = 1200
    tool_role: str = "user"  # "tool" needs a template that takes tool messages (Gemma 3's does not)
    timeout_s: float = 600.0
    progress: bool = True


def quick(s: Settings) -> Settings:
    """A smoke run of the tooling: every scenario, a fraction of the work."""
    return dataclasses.replace(
        s,
        decode_tokens=16,
        repeats=2,
        concurrency=(1, 4),
        sweep_rounds=1,
        prefill_lengths=(512, 1024),
        prefill_repeats=1,
        agent_conversations=2,
        agent_duration_s=10.0,
        agent_turns=3,
        system_words=300,
    )


# ---- statistics (pure) ----


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default); None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def stats(values: list[float], scale: float = 1.0) -> dict[str, float | int | None]:
    xs = [v * scale for v in values]
    return {
        "n": len(xs),
        "mean": sum(xs) / len(xs) if xs else None,
        "p50": percentile(xs, 50),
        "p99": percentile(xs, 99),
    }


@dataclass
class Stream:
    """One streamed request as the client saw it (perf_counter seconds)."""

    start: float
    token_times: list[float] = field(default_factory=list)  # chunks carrying text
    end: float = 0.0
    text: str = ""
    completion_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int | None = None

    @property
    def ttft(self) -> float:
        return (self.token_times[0] if self.token_times else self.end) - self.start

    @property
    def latency(self) -> float:
        return self.end - self.start

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]

    @property
    def decode_rate(self) -> float | None:
        """Tokens after the first / time after the first."""
        if self.completion_tokens < 2 or len(self.token_times) < 2 or self.token_times[-1] <= self.token_times[0]:
            return None
        return (self.completion_tokens - 1) / (self.token_times[-1] - self.token_times[0])


def stream_stats(streams: list[Stream]) -> dict[str, Any]:
    rates = [r for r in (s.decode_rate for s in streams) if r is not None]
    return {
        "requests": len(streams),
        "completion_tokens": sum(s.completion_tokens for s in streams),
        "decode_tok_s": percentile(rates, 50),
        "decode_tok_s_all": rates,
        "ttft_s": stats([s.ttft for s in streams]),
        "itl_ms": stats([d for s in streams for d in s.itls], 1000.0),
        "latency_s": stats([s.latency for s in streams]),
    }


def words_text(seed: int, n_words: int) -> str:
    """A distinct head (so no cache hit across seeds) and `n_words` words; a longer text of the same seed extends a shorter one."""
    rng = random.Random(seed)
    return f"Note {rng.getrandbits(64):016x}: " + " ".join(rng.choice(WORDS) for _ in range(n_words))


# ---- HTTP ----


class Server:
    """The server under test: streamed completions and chat, token counting."""

    def __init__(self, s: Settings, transport: httpx.AsyncBaseTransport | None = None) -> None:
        headers = {"Authorization": f"Bearer {s.api_key}"} if s.api_key else {}
        self.http = httpx.AsyncClient(
            base_url=s.base_url.rstrip("/"),
            headers=headers,
            transport=transport,
            timeout=httpx.Timeout(s.timeout_s),
            limits=httpx.Limits(max_connections=64, max_keepalive_connections=64),
        )
        self.model = s.model or "default"
        self.tokenize_path: str | None = None

    async def discover_model(self) -> str:
        r = await self.http.get("/v1/models")
        r.raise_for_status()
        self.model = r.json()["data"][0]["id"]
        return self.model

    async def count_tokens(self, text: str) -> int:
        """FreeToken: POST /v1/tokenize {"prompt"}; llama-server: POST /tokenize {"content"}."""
        for path, body in (("/v1/tokenize", {"prompt": text}), ("/tokenize", {"content": text, "add_special": True})):
            if self.tokenize_path not in (None, path):
                continue
            r = await self.http.post(path, json=body)
            if r.status_code == 200 and "tokens" in r.json():
                self.tokenize_path = path
                return len(r.json()["tokens"])
        raise BenchError("the server has neither POST /v1/tokenize nor POST /tokenize")

    async def stream(self, path: str, body: dict[str, Any]) -> Stream:
        body = {
            "model": self.model,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": True,
            **body,
        }
        out = Stream(start=time.perf_counter())
        async with self.http.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                raise BenchError(f"{path}: HTTP {r.status_code}: {(await r.aread()).decode()[:300]}")
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    break
                add_event(out, json.loads(payload), time.perf_counter())
        out.end = time.perf_counter()
        return out


def add_event(out: Stream, event: dict[str, Any], now: float) -> None:
    """Fold one SSE event (completions or chat chunk) into `out`."""
    if "error" in event:
        raise BenchError(f"stream error: {event['error']}")
    for choice in event.get("choices") or []:
        text = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
        if text:
            out.token_times.append(now)
            out.text += text
    usage = event.get("usage")
    if usage:
        out.completion_tokens = usage.get("completion_tokens", 0)
        out.prompt_tokens = usage.get("prompt_tokens", 0)
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        out.cached_tokens = cached if cached is not None else out.cached_tokens
    timings = event.get("timings")  # llama-server
    if timings and out.cached_tokens is None and "cache_n" in timings:
        out.cached_tokens = timings["cache_n"]


# ---- scenarios ----


def bar(s: Settings, desc: str, total: int | None) -> tqdm:
    return tqdm(desc=desc, total=total, unit="req", file=sys.stderr, disable=not s.progress, leave=False)


async def completion(srv: Server, prompt: str, max_tokens: int, sampling: dict[str, Any]) -> Stream:
    return await srv.stream("/v1/completions", {"prompt": prompt, "max_tokens": max_tokens, **sampling})


async def single(srv: Server, s: Settings) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, sampling in (("greedy", {"temperature": 0.0}), ("sampled", {"temperature": 0.8, "top_p": 0.95})):
        streams = []
        with bar(s, f"single {name}", s.repeats) as pb:
            for i in range(s.repeats):
                streams.append(await completion(srv, words_text(100 + i, 12), s.decode_tokens, {**sampling, "seed": i}))
                pb.update()
        out[name] = {"max_tokens": s.decode_tokens, "sampling": sampling, **stream_stats(streams)}
    return out


async def sweep(srv: Server, s: Settings) -> list[dict[str, Any]]:
    rows = []
    for c in s.concurrency:
        with bar(s, f"sweep c={c}", c * s.sweep_rounds) as pb:

            async def worker(k: int) -> list[Stream]:
                done = []
                for r in range(s.sweep_rounds):
                    done.append(
                        await completion(
                            srv, words_text(1000 * c + 10 * k + r, 12), s.decode_tokens, {"temperature": 0.0}
                        )
                    )
                    pb.update()
                return done

            t0 = time.perf_counter()
            streams = [x for w in await asyncio.gather(*(worker(k) for k in range(c))) for x in w]
            wall = time.perf_counter() - t0
        st = stream_stats(streams)
        rows.append(
            {
                "concurrency": c,
                "wall_s": wall,
                "total_tok_s": st["completion_tokens"] / wall,
                "per_stream_tok_s": st["decode_tok_s"],
                **st,
            }
        )
    return rows


async def fit_prompt(srv: Server, seed: int, target: int) -> tuple[str, int]:
    """A text of `target` tokens (within 1%), adjusting the word count by the measured ratio."""
    n_words = target
    text, n = words_text(seed, n_words), 0
    for _ in range(6):
        text = words_text(seed, n_words)
        n = await srv.count_tokens(text)
        if abs(n - target) <= max(2, target // 100):
            break
        n_words = max(1, n_words + round((target - n) * n_words / max(n, 1)))
    return text, n


async def prefill(srv: Server, s: Settings) -> list[dict[str, Any]]:
    rows = []
    for length in s.prefill_lengths:
        streams, counted = [], []
        with bar(s, f"prefill {length}", s.prefill_repeats) as pb:
            for r in range(s.prefill_repeats):
                text, n = await fit_prompt(srv, random.randrange(1 << 30), length)
                counted.append(n)
                streams.append(await completion(srv, text, 1, {"temperature": 0.0}))
                pb.update()
        ttfts = [x.ttft for x in streams]
        rows.append(
            {"prompt_tokens": length, "counted_tokens": counted, "ttft_s": percentile(ttfts, 50), "ttft_s_all": ttfts}
        )
    return rows


def tool_result(rng: random.Random) -> str:
    hits = [
        {
            "path": f"src/{rng.choice(WORDS)}_{rng.randrange(100)}.py",
            "line": rng.randrange(1, 400),
            "text": " ".join(rng.choice(WORDS) for _ in range(8)),
        }
        for _ in range(4)
    ]
    return "Tool result (search): " + json.dumps({"hits": hits})


async def agent(srv: Server, s: Settings) -> dict[str, Any]:
    system = "You are a coding agent. Follow the project notes below.\n" + words_text(7, s.system_words)
    deadline = time.perf_counter() + s.agent_duration_s
    streams: list[Stream] = []

    async def conversation(k: int, pb: tqdm) -> None:
        rng = random.Random(k)
        task = 0
        while time.perf_counter() < deadline:
            messages = [
                {"role": "system", "content": system},
                {
                    "role": "user",
                    "content": f"Task {k}.{task}: find where the {rng.choice(WORDS)} {rng.choice(WORDS)} is handled.",
                },
            ]
            for turn in range(s.agent_turns):
                if time.perf_counter() >= deadline:
                    break
                body = {"messages": messages, "max_tokens": s.agent_reply_tokens, "temperature": 0.0}
                st = await srv.stream("/v1/chat/completions", body)
                streams.append(st)
                pb.update()
                result = {"role": s.tool_role, "content": tool_result(rng)}
                if s.tool_role == "tool":
                    result["tool_call_id"] = f"call_{k}_{task}_{turn}"
                messages = [*messages, {"role": "assistant", "content": st.text or "(no text)"}, result]
            task += 1

    t0 = time.perf_counter()
    with bar(s, "agent", None) as pb:
        await asyncio.gather(*(conversation(k, pb) for k in range(s.agent_conversations)))
    wall = time.perf_counter() - t0
    st = stream_stats(streams)
    prompt = sum(x.prompt_tokens for x in streams)
    reported = [x.cached_tokens for x in streams if x.cached_tokens is not None]
    return {
        "conversations": s.agent_conversations,
        "duration_s": s.agent_duration_s,
        "wall_s": wall,
        "reply_tokens": s.agent_reply_tokens,
        "system_words": s.system_words,
        "gen_tok_s": st["completion_tokens"] / wall,
        "prompt_tokens": prompt,
        "cached_tokens": sum(reported) if reported else None,
        "cached_share": sum(reported) / prompt if reported and prompt else None,
        **st,
    }


async def run(s: Settings, transport: httpx.AsyncBaseTransport | None = None) -> dict[str, Any]:
    srv = Server(s, transport)
    try:
        if s.model is None:
            await srv.discover_model()
        await completion(srv, "Warm-up:", 4, {"temperature": 0.0})
        meta = {
            "base_url": s.base_url,
            "model": srv.model,
            "label": s.label or srv.model,
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "load_avg": list(os.getloadavg()),
            "settings": dataclasses.asdict(s) | {"api_key": None},
        }
        runners = {"single": single, "sweep": sweep, "prefill": prefill, "agent": agent}
        scenarios = {name: await runners[name](srv, s) for name in s.scenarios}
        return {"meta": meta, "scenarios": scenarios}
    finally:
        await srv.http.aclose()


# ---- report ----


def fmt(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def summary(result: dict[str, Any]) -> str:
    sc = result["scenarios"]
    lines = [f"## {result['meta']['label']} ({result['meta']['base_url']})", "", "| measure | value |", "|---|---|"]
    for name, row in sc.get("single", {}).items():
        lines.append(
            f"| single stream {name}, decode tok/s | {fmt(row['decode_tok_s'])} (ITL p50 {fmt(row['itl_ms']['p50'])} ms, p99 {fmt(row['itl_ms']['p99'])} ms) |"
        )
    for row in sc.get("sweep", []):
        lines.append(
            f"| {row['concurrency']} streams, total tok/s | {fmt(row['total_tok_s'])} (per stream {fmt(row['per_stream_tok_s'])}, TTFT p50 {fmt(row['ttft_s']['p50'], 3)} s) |"
        )
    for row in sc.get("prefill", []):
        lines.append(f"| cold TTFT, {row['prompt_tokens']} tokens | {fmt(row['ttft_s'], 3)} s |")
    if "agent" in sc:
        a = sc["agent"]
        share = "-" if a["cached_share"] is None else f"{100 * a['cached_share']:.0f}% cached"
        lines.append(
            f"| agent ({a['conversations']} conv., {a['requests']} req.), gen tok/s | {fmt(a['gen_tok_s'])} "
            f"(latency p50 {fmt(a['latency_s']['p50'], 2)} s, p99 {fmt(a['latency_s']['p99'], 2)} s, {share}) |"
        )
    return "\n".join(lines)


def plot(results: list[dict[str, Any]], out: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot skipped: matplotlib is not installed (pip install matplotlib)", file=sys.stderr)
        return
    fig, (ax_sweep, ax_ttft, ax_single) = plt.subplots(1, 3, figsize=(15, 4.5))
    width = 0.8 / len(results)
    for i, res in enumerate(results):
        sc, label = res["scenarios"], res["meta"]["label"]
        if sc.get("sweep"):
            cs = [r["concurrency"] for r in sc["sweep"]]
            ax_sweep.plot(
                cs, [r["total_tok_s"] for r in sc["sweep"]], marker="o", color=f"C{i}", label=f"{label} total"
            )
            ax_sweep.plot(
                cs,
                [r["per_stream_tok_s"] or 0 for r in sc["sweep"]],
                marker=".",
                linestyle="--",
                color=f"C{i}",
                label=f"{label} per stream",
            )
        if sc.get("prefill"):
            xs = range(len(sc["prefill"]))
            ax_ttft.bar(
                [x + i * width for x in xs], [r["ttft_s"] for r in sc["prefill"]], width, color=f"C{i}", label=label
            )
            ax_ttft.set_xticks([x + 0.4 - width / 2 for x in xs], [str(r["prompt_tokens"]) for r in sc["prefill"]])
        bars = {f"single {k}": v["decode_tok_s"] or 0 for k, v in sc.get("single", {}).items()}
        if "agent" in sc:
            bars["agent gen."] = sc["agent"]["gen_tok_s"]
        ax_single.bar([x + i * width for x in range(len(bars))], list(bars.values()), width, color=f"C{i}", label=label)
        ax_single.set_xticks([x + 0.4 - width / 2 for x in range(len(bars))], list(bars))
    ax_sweep.set(xscale="log", xlabel="concurrent streams", ylabel="generated tokens/s", title="concurrency sweep")
    ax_sweep.set_xticks([1, 2, 4, 8, 16], ["1", "2", "4", "8", "16"])
    ax_ttft.set(xlabel="prompt tokens", ylabel="seconds", title="cold time to first token")
    ax_single.set(ylabel="tokens/s", title="single-stream decode, agent workload")
    for ax in (ax_sweep, ax_ttft, ax_single):
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


# ---- CLI ----


def settings_of(argv: list[str]) -> tuple[Settings, argparse.Namespace]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base-url", required=True)
    p.add_argument("--model", help="the model name to send (default: the first of /v1/models)")
    p.add_argument("--api-key")
    p.add_argument("--label", help="the name in tables and plots (default: the model)")
    p.add_argument("--out", help="write the result JSON here")
    p.add_argument("--plot", help="write a PNG plot here")
    p.add_argument("--scenarios", nargs="+", choices=SCENARIOS, default=list(SCENARIOS))
    p.add_argument("--quick", action="store_true", help="a smoke run: every scenario, a fraction of the work")
    p.add_argument("--agent-conversations", type=int)
    p.add_argument("--agent-duration", type=float, help="seconds")
    p.add_argument("--no-progress", action="store_true")
    a = p.parse_args(argv)
    s = Settings(
        base_url=a.base_url,
        model=a.model,
        api_key=a.api_key,
        label=a.label,
        scenarios=tuple(a.scenarios),
        progress=not a.no_progress,
    )
    s = quick(s) if a.quick else s
    if a.agent_conversations is not None:
        s = dataclasses.replace(s, agent_conversations=a.agent_conversations)
    if a.agent_duration is not None:
        s = dataclasses.replace(s, agent_duration_s=a.agent_duration)
    return s, a


def main(argv: list[str]) -> None:
    if argv[:1] == ["plot"]:
        p = argparse.ArgumentParser(prog="serving.py plot", description="plot one or more result files side by side")
        p.add_argument("results", nargs="+")
        p.add_argument("--out", required=True)
        a = p.parse_args(argv[1:])
        results = []
        for path in a.results:
            with open(path) as f:
                results.append(json.load(f))
        plot(results, a.out)
        return
    s, a = settings_of(argv)
    result = asyncio.run(run(s))
    print(summary(result))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
    if a.plot:
        plot([result], a.plot)


if __name__ == "__main__":
    main(sys.argv[1:])
