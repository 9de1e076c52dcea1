"""FreeToken beside llama.cpp's `llama-server`: same GGUF, same thread count, one server after the other.

    python benchmarks/peer.py [--models gemma3-270m smollm2-135m-instruct] [--threads N]
                              [--out-dir bench-out] [--llama-server PATH] [--quick] [--paired-rounds R]

For each model: start llama-server (`-np 8`, continuous batching, enough context per slot), wait
for /health, run benchmarks/serving.py against it, stop it; then the same for `ft serve`. Writes
`<model>-llama-server.json`, `<model>-freetoken.json`, `<model>.md` (both servers with the ratio
FreeToken / llama-server) and `<model>.png`. With `--paired-rounds R`, both servers are then
started together and the single-stream and cold-prefill scenarios alternate between them for R
rounds (the order swapped each round): the per-round ratios cancel a drift of the shared machine's
speed, which a run of one server after the other cannot (`<model>-paired.json`, a table appended
to `<model>.md`).

Owns building llama-server from the `llama-cpp-python` source package (pip download, then cmake +
ninja on its vendored llama.cpp, cached in `--cache-dir`, default ~/.cache/freetoken/llama.cpp),
the server processes, their peak memory (psutil over the process tree) and the load average at
start. It measures no request itself: serving.py does, with the same settings for both servers.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib.util
import json
import os
import shlex
import shutil
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

from freetoken.utils.ports import free_port


def _sibling(name: str) -> Any:
    """A sibling script loaded by path as `bench_<name>` (a plain `import serving` could pick up
    another module of that name, e.g. the server tests' helper, when both run in one process)."""
    key = f"bench_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, Path(__file__).resolve().parent / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        spec.loader.exec_module(module)
    return sys.modules[key]


serving = _sibling("serving")

DEFAULT_CACHE = Path.home() / ".cache" / "freetoken" / "llama.cpp"


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.split(":", 1)[-1].split())


def native_cmake_flags() -> list[str]:
    """-DGGML_NATIVE=ON, except on a CPU with AMX: llama.cpp's AMX matmul crashes there (a known
    llama.cpp bug), so the peer is built with the AVX-512 / VNNI / BF16 options named and AMX off."""
    flags = _cpu_flags()
    if not any(f.startswith("amx") for f in flags):
        return ["-DGGML_NATIVE=ON"]
    on = lambda name, flag: [f"-D{name}={'ON' if flag in flags else 'OFF'}"]  # noqa: E731
    return (["-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON",
             "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]
            + on("GGML_AVX512", "avx512f") + on("GGML_AVX512_VNNI", "avx512_vnni")
            + on("GGML_AVX512_VBMI", "avx512vbmi") + on("GGML_AVX512_BF16", "avx512_bf16"))


def build_llama_tool(cache: Path, target: str) -> Path:
    """The cached binary `target` (llama-server, llama-quantize), or download the sdist, unpack it
    and build only that target."""
    binary = cache / "build" / "bin" / target
    if binary.exists():
        return binary
    src = cache / "src"
    src.mkdir(parents=True, exist_ok=True)
    if not list(src.glob("llama_cpp_python-*.tar.gz")):
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                        "llama-cpp-python", "-d", str(src)], check=True)
    sdist = sorted(src.glob("llama_cpp_python-*.tar.gz"))[-1]
    root = src / sdist.name.removesuffix(".tar.gz")
    if not root.exists():
        with tarfile.open(sdist) as tar:
            tar.extractall(src, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    if not (cache / "build" / "build.ninja").exists():
        subprocess.run(["cmake", "-S", str(root / "vendor" / "llama.cpp"), "-B", str(cache / "build"), "-G", "Ninja",
                        "-DCMAKE_BUILD_TYPE=Release", *native_cmake_flags(), "-DLLAMA_CURL=OFF",
                        "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF"], check=True)
    subprocess.run(["ninja", "-C", str(cache / "build"), target], check=True)
    return binary


def build_llama_server(cache: Path) -> Path:
    return build_llama_tool(cache, "llama-server")


class ServerProcess:
    """One server in its own process group, with a thread sampling the tree's memory."""

    def __init__(self, cmd: list[str], port: int, log: Path) -> None:
        self.cmd, self.port, self.log_path = cmd, port, log
        self.load_at_start = list(os.getloadavg())
        self.uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
        self.log = open(log, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        self.peak_rss = 0  # sum over the tree; shared pages (torch's libraries in two processes) count twice
        self.peak_pss = 0  # proportional: shared pages split between the processes that map them
        self.stopping = threading.Event()
        self.sampler = threading.Thread(target=self.sample, daemon=True)
        self.sampler.start()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def sample(self) -> None:
        root = psutil.Process(self.proc.pid)
        while not self.stopping.wait(0.5):
            rss = pss = 0
            try:
                for p in [root, *root.children(recursive=True)]:
                    mem = p.memory_full_info()
                    rss, pss = rss + mem.rss, pss + getattr(mem, "pss", mem.rss)
            except psutil.Error:
                continue  # a process came or went mid-walk; the next sample counts it
            self.peak_rss, self.peak_pss = max(self.peak_rss, rss), max(self.peak_pss, pss)

    def wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.cmd[0]} exited with {self.proc.returncode}; see {self.log_path}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.cmd[0]} not healthy after {timeout_s:.0f} s; see {self.log_path}")

    def stop(self) -> None:
        self.stopping.set()
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 15)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait()
        self.log.close()

    def record(self) -> dict[str, Any]:
        return {"command": shlex.join(self.cmd), "peak_rss_mb": self.peak_rss / 2**20,
                "peak_pss_mb": self.peak_pss / 2**20, "load_avg_at_start": self.load_at_start, "uptime_at_start": self.uptime}


def llama_cmd(binary: Path, gguf: str, threads: int, parallel: int, slot_ctx: int, port: int, extra: str) -> list[str]:
    return [str(binary), "-m", gguf, "-t", str(threads), "-tb", str(threads), "-np", str(parallel),
            "-c", str(parallel * slot_ctx), "-cb", "--host", "127.0.0.1", "--port", str(port), *shlex.split(extra)]


def ft_cmd(gguf: str, threads: int, kv_tokens: int, port: int, extra: str) -> list[str]:
    ft = shutil.which("ft")
    head = [ft] if ft else [sys.executable, "-c", "import sys; from freetoken.cli import main; sys.exit(main())"]
    # the same KV capacity as llama-server's -c (without it the pool takes 30% of free memory,
    # which shows as peak RSS); `extra` comes last, so --ft-args "--num-tokens N" overrides it
    return [*head, "serve", "--model", gguf, "--threads", str(threads), "--num-tokens", str(kv_tokens), "--enable-cache-report",
            "--host", "127.0.0.1", "--port", str(port), *shlex.split(extra)]


def bench(cmd: list[str], port: int, label: str, settings: serving.Settings, log: Path, out: Path, start_timeout_s: float) -> dict[str, Any]:
    print(f"\n== {label}: {shlex.join(cmd)}", file=sys.stderr)
    server = ServerProcess(cmd, port, log)
    try:
        server.wait_healthy(start_timeout_s)
        result = asyncio.run(serving.run(dataclasses.replace(settings, base_url=server.base_url, label=label)))
    finally:
        server.stop()
    result["meta"]["server"] = server.record() | {"version": version(cmd)}
    out.write_text(json.dumps(result, indent=1))
    print(serving.summary(result))
    return result


def version(cmd: list[str]) -> str:
    """llama-server's build line, or FreeToken's version and the checkout's commit."""
    if "serve" not in cmd:
        out = subprocess.run([cmd[0], "--version"], capture_output=True, text=True)
        return (out.stdout + out.stderr).strip().splitlines()[0]
    import freetoken
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent)
    return f"freetoken {freetoken.__version__} ({commit.stdout.strip() or 'no git'})"


def ratio(a: float | None, b: float | None) -> str:
    return "-" if not a or b is None else f"{b / a:.2f}x"


def comparison(llama: dict[str, Any], ft: dict[str, Any]) -> str:
    """A markdown table: measure | llama-server | ft serve | ratio (ft / llama; above 1 is better for rates)."""
    rows: list[tuple[str, float | None, float | None, int]] = []
    la, fa = llama["scenarios"], ft["scenarios"]
    for name in la.get("single", {}):
        rows.append((f"single stream {name}, tok/s", la["single"][name]["decode_tok_s"], fa["single"][name]["decode_tok_s"], 1))
        rows.append((f"single stream {name}, ITL p99 ms (lower is better)", la["single"][name]["itl_ms"]["p99"], fa["single"][name]["itl_ms"]["p99"], 1))
    for lr, fr in zip(la.get("sweep", []), fa.get("sweep", [])):
        rows.append((f"{lr['concurrency']} concurrent streams, total tok/s", lr["total_tok_s"], fr["total_tok_s"], 1))
        rows.append((f"{lr['concurrency']} concurrent streams, per stream tok/s", lr["per_stream_tok_s"], fr["per_stream_tok_s"], 1))
    for lr, fr in zip(la.get("prefill", []), fa.get("prefill", [])):
        rows.append((f"cold TTFT, {lr['prompt_tokens']}-token prompt, s (lower is better)", lr["ttft_s"], fr["ttft_s"], 3))
    if "agent" in la and "agent" in fa:
        a, f = la["agent"], fa["agent"]
        rows.append((f"agent ({a['conversations']} conversations, {a['reply_tokens']}-token replies), gen. tok/s", a["gen_tok_s"], f["gen_tok_s"], 1))
        rows.append(("agent request latency p50, s (lower is better)", a["latency_s"]["p50"], f["latency_s"]["p50"], 2))
        rows.append(("agent request latency p99, s (lower is better)", a["latency_s"]["p99"], f["latency_s"]["p99"], 2))
        rows.append(("agent prompt tokens cached, %", pct(a["cached_share"]), pct(f["cached_share"]), 0))
    for key in ("peak_rss_mb", "peak_pss_mb"):
        ls, fs = llama["meta"].get("server", {}), ft["meta"].get("server", {})
        if key in ls and key in fs:
            rows.append((f"server {key[5:8].upper()} peak, MB (lower is better)", ls[key], fs[key], 0))
    lines = ["| measure | llama-server | ft serve | ratio |", "|---|---|---|---|"]
    # a share has no meaningful ratio (0% cached against 47% is not "362x")
    lines += [f"| {m} | {serving.fmt(a, d)} | {serving.fmt(b, d)} | {'-' if m.endswith('%') else ratio(a, b)} |" for m, a, b, d in rows]
    return "\n".join(lines)


paired = importlib.import_module("freetoken.bench.paired")
PAIRED_SCENARIOS = paired.PAIRED_SCENARIOS
paired_measures = paired.paired_measures
paired_table = paired.paired_table


def paired_rounds(servers: dict[str, list[str]], ports: dict[str, int], rounds: int, settings: serving.Settings,
                  out_dir: Path, stem: str, start_timeout_s: float,
                  scenarios: tuple[str, ...] = PAIRED_SCENARIOS) -> list[dict[str, dict[str, float]]]:
    """Both servers up at once (each idle while the other is measured), then
    `freetoken.bench.paired.run_rounds` over them. Returns per round {server: {measure: value}}."""
    procs = {name: ServerProcess(cmd, ports[name], out_dir / f"{stem}-{name}-paired.log") for name, cmd in servers.items()}
    try:
        for proc in procs.values():
            proc.wait_healthy(start_timeout_s)
        return paired.run_rounds({name: proc.base_url for name, proc in procs.items()}, rounds, settings, scenarios)
    finally:
        for proc in procs.values():
            proc.stop()


def pct(share: float | None) -> float | None:
    return None if share is None else 100 * share


def model_path(name: str) -> str:
    if name.endswith(".gguf"):
        return name
    from freetoken.weights.source import resolve_model
    return str(resolve_model(name).path)


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=["gemma3-270m", "smollm2-135m-instruct"], help="short names or .gguf paths")
    p.add_argument("--threads", type=int, default=psutil.cpu_count(logical=False) or os.cpu_count() or 1)
    p.add_argument("--out-dir", default="bench-out", help="(git-ignored at the repo root)")
    p.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE, help="where llama-server is built (default %(default)s)")
    p.add_argument("--llama-server", type=Path, help="an existing llama-server binary (skips the build)")
    p.add_argument("--parallel", type=int, default=8, help="llama-server slots (-np)")
    p.add_argument("--slot-ctx", type=int, default=4096, help="context per llama-server slot; both servers get parallel x this KV tokens (-c, --num-tokens)")
    p.add_argument("--llama-args", default="", help="extra llama-server flags")
    p.add_argument("--ft-args", default="", help="extra ft serve flags")
    p.add_argument("--servers", nargs="+", choices=["llama-server", "freetoken"], default=["llama-server", "freetoken"])
    p.add_argument("--scenarios", nargs="+", choices=serving.SCENARIOS, default=list(serving.SCENARIOS))
    p.add_argument("--start-timeout", type=float, default=300.0, help="seconds a server may take to answer /health 200")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--paired-rounds", type=int, default=0, metavar="R",
                   help="after the runs, R rounds of the single stream and cold prefill with both servers up, alternating (drift-free ratios)")
    p.add_argument("--paired-scenarios", nargs="+", choices=serving.SCENARIOS[:3], default=list(paired.PAIRED_SCENARIOS),
                   help="what the paired rounds measure (sweep: 4 and 8 concurrent streams)")
    p.add_argument("--ik-llama-server", type=Path,
                   help="ik_llama.cpp's llama-server (built with its AVX-512 flags): a third server in the paired rounds, run with -rtr")
    a = p.parse_args(argv)
    binary = (a.llama_server or build_llama_server(a.cache_dir)) if "llama-server" in a.servers else None
    out_dir = Path(a.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    settings = serving.Settings(base_url="", scenarios=tuple(a.scenarios))
    settings = serving.quick(settings) if a.quick else settings
    for name in a.models:
        gguf, stem = model_path(name), Path(name).stem
        results: dict[str, dict[str, Any]] = {}
        for server in a.servers:
            port = free_port()
            cmd = (llama_cmd(binary, gguf, a.threads, a.parallel, a.slot_ctx, port, a.llama_args) if server == "llama-server" and binary
                   else ft_cmd(gguf, a.threads, a.parallel * a.slot_ctx, port, a.ft_args))
            results[server] = bench(cmd, port, "llama-server" if server == "llama-server" else "ft serve", settings,
                                    out_dir / f"{stem}-{server}.log", out_dir / f"{stem}-{server}.json", a.start_timeout)
        if len(results) == 2:
            head = f"# {stem}: {a.threads} threads, {Path(gguf).name}\n\n"
            table = head + comparison(results["llama-server"], results["freetoken"]) + "\n"
            (out_dir / f"{stem}.md").write_text(table)
            print("\n" + table)
        serving.plot(list(results.values()), str(out_dir / f"{stem}.png"))
        if a.paired_rounds and binary is not None:
            ports = {"llama-server": free_port(), "freetoken": free_port()}
            cmds = {"llama-server": llama_cmd(binary, gguf, a.threads, a.parallel, a.slot_ctx, ports["llama-server"], a.llama_args),
                    "freetoken": ft_cmd(gguf, a.threads, a.parallel * a.slot_ctx, ports["freetoken"], a.ft_args)}
            if a.ik_llama_server:
                ports["ik_llama.cpp"] = free_port()
                cmds["ik_llama.cpp"] = llama_cmd(a.ik_llama_server, gguf, a.threads, a.parallel, a.slot_ctx,
                                                 ports["ik_llama.cpp"], a.llama_args + " -rtr")
            paired_settings = dataclasses.replace(settings, concurrency=(4, 8))
            rounds = paired_rounds(cmds, ports, a.paired_rounds, paired_settings, out_dir, stem, a.start_timeout,
                                   tuple(a.paired_scenarios))
            (out_dir / f"{stem}-paired.json").write_text(json.dumps(rounds, indent=1))
            what = ", ".join(a.paired_scenarios)
            table = "".join(f"\n## Paired rounds against {peer} ({what}; {a.paired_rounds} rounds, all servers up, alternating)\n\n"
                            f"{paired_table(rounds, 'freetoken', peer)}\n" for peer in cmds if peer != "freetoken")
            with open(out_dir / f"{stem}.md", "a") as f:
                f.write(table)
            print(table)


if __name__ == "__main__":
    main(sys.argv[1:])
