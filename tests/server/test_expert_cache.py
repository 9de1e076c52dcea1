"""The expert cache of `--moe-strategy offload` through a real `ft serve` (tiny gpt-oss, MXFP4
experts, a cache of about two of its eight experts, --debug-kv): the `experts` section of
`/v1/cache/status`, the `freetoken_expert_cache_*` metrics, and `expert_cache_gb` in
`POST /admin/cache/resize` (checked, applied, combined with a KV resize), with the pools
balanced and no violation afterwards."""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import API_KEY
from serving import ServeProcess, assert_pools_balanced, serving

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
from test_experts_resize import write_mxfp4_gpt_oss

MODEL = "tiny-moe"
CACHE_GB = 0.000013  # ~14 KB: two of the eight 6.9 KB experts (int8 from MXFP4)


@pytest.fixture(scope="module")
def moe_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    directory = write_mxfp4_gpt_oss(tmp_path_factory.mktemp("tiny_moe"))
    flags = ["--served-model-name", MODEL, "--moe-strategy", "offload", "--expert-cache-gb", str(CACHE_GB),
             "--page-size", "4", "--num-tokens", "512", "--dtype", "float32", "--debug-kv"]
    with serving(str(directory), flags, tmp_path_factory.mktemp("logs") / "moe.log", api_key=API_KEY) as proc:
        yield proc


def complete(server: ServeProcess, prompt: list[int]) -> None:
    with server.http() as c:
        r = c.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0,
                                            "ignore_eos": True})
    assert r.status_code == 200, r.text


def status(server: ServeProcess) -> dict:
    with server.http() as c:
        return c.get("/v1/cache/status").json()


def metric(server: ServeProcess, name: str) -> float:
    with server.http() as c:
        text = c.get("/metrics").text
    found = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
    assert found, f"{name} not in /metrics"
    return float(found.group(1))


def resize(server: ServeProcess, body: object) -> httpx.Response:
    return httpx.post(f"{server.base}/admin/cache/resize", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {API_KEY}"})


def test_offload_counters_and_elastic_resize(moe_server: ServeProcess) -> None:
    for i in range(3):
        complete(moe_server, [11 + i, 40, 77, 123, 5, 260, 31, 99])
    experts = status(moe_server)["experts"]
    assert experts["strategy"] == "offload" and experts["experts"] == 8
    cache = experts["cache"]
    assert cache["misses"] > 0 and cache["evictions"] > 0 and cache["bytes"] <= cache["capacity_bytes"]
    assert metric(moe_server, "freetoken_expert_cache_misses") == cache["misses"]
    assert metric(moe_server, "freetoken_expert_cache_capacity_bytes") == cache["capacity_bytes"]

    r = resize(moe_server, {"expert_cache_gb": -1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "expert_cache_gb"
    r = resize(moe_server, {"expert_cache_gb": 0.001, "full_tokens": 768})  # the whole model fits now
    assert r.status_code == 200, r.text
    assert r.json()["pools"]["experts"]["capacity_bytes"] == int(0.001 * (1 << 30))
    assert r.json()["pools"]["full"]["capacity"] == 768 // 4
    grown = status(moe_server)["experts"]["cache"]
    for _ in range(2):
        complete(moe_server, [11, 40, 77, 123, 5, 260, 31, 99])
    after = status(moe_server)
    now = after["experts"]["cache"]
    assert now["evictions"] == grown["evictions"] and now["misses"] <= grown["misses"] + 8  # each expert once at most
    assert now["hits"] > grown["hits"]
    assert after["integrity"]["violations"] == 0
    assert_pools_balanced(after)
