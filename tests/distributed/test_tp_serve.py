"""`ft serve --tensor-parallel-size 2` (two gloo ranks, one thread each) on tiny random-weight Gemma 3
(sliding layers), Llama and gpt-oss (experts): the same greedy completions as the one-process
engine; on Gemma 3, killing rank 1 takes the engine
down as one unit (the in-flight stream ends with an error, /health 503) and the supervisor's
restart brings both ranks back; no rank outlives the server; and world sizes that cannot split
the model are refused before anything listens, with one line. The stream killed under rank 1 is
held in the engine after its first token (`--test-hold`, tests/server/hold.py), so it is in
flight at the SIGKILL however fast the machine."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest
from hold import EngineHold
from serving import ServeProcess, pid_alive, serving

from freetoken.distributed.checks import check_world_fits
from freetoken.errors import ConfigError
from freetoken.request import SamplingParams

FLAGS = ["--page-size", "4", "--num-tokens", "2048", "--max-running-requests", "4", "--max-prefill-length", "12",
         "--debug-kv", "--dtype", "float32", "--threads", "1", "--tensor-parallel-size", "2"]
PROMPTS = [[(5 * i + 7 * j) % 300 + 3 for j in range(n)] for i, n in enumerate((9, 23, 4))]  # 23 > the window (7)
MAX_TOKENS = 10
RESTART_DEADLINE_S = 240


# One server per family, ~20 s each on two busy cores: Llama's and gpt-oss's servers are marked
# (the logits tests cover every family without a server); Gemma 3's also runs the kill test.
FAMILIES = ["gemma3", *(pytest.param(f, marks=pytest.mark.tp_serve_families) for f in ("llama", "gpt_oss"))]


@pytest.fixture(scope="module", params=FAMILIES)
def family_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-weight model directory of each family (gpt-oss from the model-parity harness)."""
    from tiny_models import write_tiny_model

    directory = tmp_path_factory.mktemp(f"tp_serve_{request.param}") / "tiny-model"
    if request.param != "gpt_oss":
        return write_tiny_model(request.param, directory)
    from model_harness import VOCAB, make_reference

    from freetoken.tokenizer.testing import write_tiny_tokenizer

    make_reference("gpt_oss", directory)
    write_tiny_tokenizer(directory, vocab_size=VOCAB)
    return directory


@pytest.fixture(scope="module")
def tp_hold(tmp_path_factory: pytest.TempPathFactory) -> EngineHold:
    return EngineHold(tmp_path_factory.mktemp("tp_hold") / "hold")


@pytest.fixture(scope="module")
def tp_server(family_dir: Path, tp_hold: EngineHold, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    ranks: set[int] = set()
    with serving(str(family_dir), [*FLAGS, *tp_hold.flags], tmp_path_factory.mktemp("tp_logs") / "tp.log") as proc:
        proc.rank_pids = ranks  # type: ignore[attr-defined]
        yield proc
    assert ranks and not [pid for pid in ranks if pid_alive(pid)], "a tensor-parallel rank outlived the server"


def rank_pids(server: ServeProcess) -> list[int]:
    """The live ranks 1..N-1: children of the engine process (rank 0)."""
    engine = psutil.Process(server.wait_healthy()["pid"])
    pids = [c.pid for c in engine.children() if "freetoken.distributed.follower" in " ".join(c.cmdline())]
    server.rank_pids.update(pids)  # type: ignore[attr-defined]
    return pids


def completion(server: ServeProcess, prompt: list[int]) -> str:
    body = {"model": "tiny-model", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{server.base}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == MAX_TOKENS
    return str(r.json()["choices"][0]["text"])


@pytest.fixture(scope="module")
def one_process_texts(family_dir: Path) -> list[str]:
    from freetoken.llm import LLM

    llm = LLM(str(family_dir), dtype="float32", page_size=4, num_tokens=2048, max_prefill_length=12, threads=1)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return [out.text for out in llm.generate(PROMPTS, params)]


def test_tp2_serves_the_one_process_greedy_completions(tp_server: ServeProcess, one_process_texts: list[str]) -> None:
    assert len(rank_pids(tp_server)) == 1
    assert [completion(tp_server, p) for p in PROMPTS] == one_process_texts
    assert len(set(one_process_texts)) == len(PROMPTS)  # distinct prompts, distinct completions
    tp_server.assert_balanced_idle()


@pytest.mark.parametrize("family_dir", ["gemma3"], indirect=True)
def test_killing_rank_1_restarts_the_engine(tp_server: ServeProcess, tp_hold: EngineHold, one_process_texts: list[str]) -> None:
    healthy = tp_server.wait_healthy()
    (rank1,) = rank_pids(tp_server)
    body = {"model": "tiny-model", "prompt": PROMPTS[0], "max_tokens": 100, "temperature": 0, "ignore_eos": True,
            "stream": True}
    events: list[str] = []
    tp_hold.decode_after(1)
    try:
        with httpx.Client(base_url=tp_server.base, timeout=120) as c, c.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            for line in lines:
                if line.startswith("data: "):
                    events.append(line)
                    break
            os.kill(rank1, signal.SIGKILL)  # the stream is held after its first token: still in flight
            events.extend(line for line in lines if line.startswith("data: "))  # must end, not hang
    finally:
        tp_hold.release()
    assert "data: [DONE]" not in events
    assert "error" in json.loads(events[-1][6:]), events[-1]
    deadline = time.monotonic() + RESTART_DEADLINE_S
    health = httpx.get(f"{tp_server.base}/health", timeout=30)
    while health.status_code != 200 and time.monotonic() < deadline:
        assert health.json()["status"] == "error" and health.json()["message"]
        time.sleep(0.2)
        health = httpx.get(f"{tp_server.base}/health", timeout=30)
    assert health.status_code == 200, health.text
    assert health.json()["restarts"] == healthy["restarts"] + 1 and health.json()["pid"] != healthy["pid"]
    tp_server.engine_pids.add(health.json()["pid"])
    assert not pid_alive(healthy["pid"])  # rank 0 went down with rank 1
    new_ranks = rank_pids(tp_server)
    assert len(new_ranks) == 1 and new_ranks != [rank1]
    assert completion(tp_server, PROMPTS[1]) == one_process_texts[1]


@pytest.mark.parametrize("family_dir", ["gemma3"], indirect=True)
@pytest.mark.parametrize(("world", "needle"), [(3, "does not divide the model's 4 attention heads")])
def test_unsplittable_world_size_is_refused_before_listening(family_dir: Path, world: int, needle: str) -> None:
    cmd = [sys.executable, "-m", "freetoken.cli", "serve", "--model", str(family_dir), "--port", "0",
           "--tensor-parallel-size", str(world)]
    done = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0] and "--tensor-parallel-size" in lines[0], done.stderr


def test_more_ranks_than_cores_is_refused() -> None:
    cores = len(os.sched_getaffinity(0))
    check_world_fits(cores, cuda=False, cuda_devices=0)
    with pytest.raises(ConfigError, match=f"--tensor-parallel-size {cores + 1} is more than the {cores} CPU cores"):
        check_world_fits(cores + 1, cuda=False, cuda_devices=0)
    with pytest.raises(ConfigError, match="more than the 1 CUDA devices"):
        check_world_fits(2, cuda=True, cuda_devices=1)


@pytest.mark.parametrize("family_dir", ["gemma3"], indirect=True)
def test_killing_rank_0_takes_rank_1_with_it(tp_server: ServeProcess, one_process_texts: list[str]) -> None:
    healthy = tp_server.wait_healthy()
    (rank1,) = rank_pids(tp_server)
    os.kill(healthy["pid"], signal.SIGKILL)
    deadline = time.monotonic() + RESTART_DEADLINE_S
    while pid_alive(rank1) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not pid_alive(rank1), "rank 1 outlived rank 0"
    while time.monotonic() < deadline:
        health = httpx.get(f"{tp_server.base}/health", timeout=30)
        if health.status_code == 200 and health.json()["pid"] != healthy["pid"]:
            break
        time.sleep(0.2)
    assert health.status_code == 200 and health.json()["restarts"] == healthy["restarts"] + 1, health.text
    tp_server.engine_pids.add(health.json()["pid"])
    assert completion(tp_server, PROMPTS[2]) == one_process_texts[2]


def test_heads_are_read_from_gguf_metadata() -> None:
    """The pre-listen check reads a GGUF's head counts from its metadata alone (no tensors)."""
    from freetoken.distributed.checks import check_model_heads

    check_model_heads("gemma3-270m", 2)  # 4 heads, 1 KV head: replicated on both ranks; a declared model: no skip
    with pytest.raises(ConfigError, match="--tensor-parallel-size 3 does not divide the model's 4 attention heads"):
        check_model_heads("gemma3-270m", 3)
