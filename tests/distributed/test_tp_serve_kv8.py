"""`ft serve --tensor-parallel-size 2 --kv-cache-dtype int8 --weights int8` on a tiny Gemma 3 with one
KV head (replicated on both ranks, as in Gemma 3 270M): every rank stores 8-bit K/V (rank 1 used
to allocate float K/V whatever the flag said), rank 0 logs each rank's weight plan and K/V bytes,
and concurrent greedy requests over a shared prefix (served from the prefix cache) return the
one-process engine's texts."""

from __future__ import annotations

import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from serving import ServeProcess, serving

from freetoken.request import SamplingParams

ENGINE = ["--page-size", "4", "--num-tokens", "2048", "--max-running-requests", "4", "--max-prefill-length", "12",
          "--dtype", "float32", "--threads", "1", "--kv-cache-dtype", "int8", "--weights", "int8"]
SHARED = [(7 * j) % 300 + 3 for j in range(21)]  # crosses the window (7) and several pages
PROMPTS = [SHARED + [(11 * i + 5 * j) % 300 + 3 for j in range(n)] for i, n in enumerate((3, 9, 1, 14))]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tiny_models import write_tiny_model

    # MLP width 128: each rank's 64 columns are whole blocks of torch's vectorized activation.
    directory = tmp_path_factory.mktemp("tp_kv8") / "tiny-model"
    return write_tiny_model("gemma3", directory, num_key_value_heads=1, intermediate_size=128)


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    flags = [*ENGINE, "--tensor-parallel-size", "2", "--debug-kv", "--enable-cache-report"]
    with serving(str(model_dir), flags, tmp_path_factory.mktemp("tp_kv8_logs") / "tp.log") as proc:
        yield proc


def one_process_texts(model_dir: Path) -> list[str]:
    from freetoken.config import EngineConfig
    from freetoken.llm import LLM

    llm = LLM(config=EngineConfig(model=str(model_dir), dtype="float32", page_size=4, num_tokens=2048, max_prefill_length=12,
                                  threads=1, kv_cache_dtype="int8", weights="int8"))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return [out.text for out in llm.generate(PROMPTS, params)]


def completion(server: ServeProcess, prompt: list[int]) -> dict[str, object]:
    body = {"model": "tiny-model", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{server.base}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return dict(r.json())


def test_int8_kv_on_every_rank_gives_the_one_process_texts(server: ServeProcess, model_dir: Path) -> None:
    server.wait_healthy()
    reports = re.findall(r"tensor parallelism, rank (\d): weights (.*); K/V (\d+) bytes of (\w+)", server.log_path.read_text(errors="replace"))
    assert [r[0] for r in reports] == ["0", "1"], server.log()[-3000:]
    assert {(r[1], r[2], r[3]) for r in reports} == {(reports[0][1], reports[0][2], "int8")}  # the same on both
    assert "int8 x" in reports[0][1]

    first = completion(server, PROMPTS[0])  # the shared prefix enters the cache
    with ThreadPoolExecutor(len(PROMPTS) - 1) as pool:  # the rest at once: batched, prefix hits
        rest = list(pool.map(lambda p: completion(server, p), PROMPTS[1:]))
    outputs = [first, *rest]
    texts = [str(o["choices"][0]["text"]) for o in outputs]  # type: ignore[index]
    cached = [o["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0) for o in rest]  # type: ignore[union-attr]
    assert all(c >= 8 for c in cached), cached  # the shared prefix came from the cache
    assert texts == one_process_texts(model_dir)
    assert len(set(texts)) == len(PROMPTS)
    server.assert_balanced_idle()
