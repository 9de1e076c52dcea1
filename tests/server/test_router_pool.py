"""Two `ft serve` replicas behind a real cache-aware router (sglang-router, vllm-router), through
benchmarks/router.py on a tiny model with a 4096-token context: later turns of a conversation
land on the replica that holds its prefix, the hit rate beats round-robin over the same
replicas, a drained replica leaves the pool without a failed request, and a killed one loses
only what it had in flight. Needs the `router` extra (pip install -e '.[router]'), and runs only
when asked for by marker, being slow (about 40 s per router on two cores):

    python -m pytest -q -m router tests/server/test_router_pool.py
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.router

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"sglang": "sglang_router", "vllm": "vllm_router"}


def load_bench() -> Any:
    """benchmarks/router.py, loaded by path (as benchmarks/peer.py loads its siblings)."""
    if "bench_router" not in sys.modules:
        spec = importlib.util.spec_from_file_location("bench_router", ROOT / "benchmarks" / "router.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules["bench_router"] = module
        spec.loader.exec_module(module)
    return sys.modules["bench_router"]


@pytest.fixture(scope="module")
def long_context_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Four turns of the agent workload pass the tiny models' 1024 positions (byte tokens)."""
    from tiny_models import write_tiny_model

    return write_tiny_model("llama", tmp_path_factory.mktemp("router_model") / "tiny-llama-4k", max_position_embeddings=4096)


def asked_for(config: pytest.Config) -> bool:
    """True when the run's `-m` expression selects the `router` marker (the default run does not)."""
    expr = str(config.getoption("markexpr") or "")
    return "router" in expr and "not router" not in expr


@pytest.mark.parametrize("router", ["sglang", "vllm"])
def test_replicas_behind_a_cache_aware_router(router: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    if not asked_for(request.config):
        pytest.skip("slow: run with -m router")
    pytest.importorskip(PACKAGES[router], reason=f"{router}-router is not installed (pip install -e '.[router]')")
    long_context_model = request.getfixturevalue("long_context_model")
    bench = load_bench()
    settings = bench.Settings(model=str(long_context_model), router=router, conversations=3, turns=4,
                              serve_flags=("--dtype=float32",), log_dir=str(tmp_path))
    r = bench.run(settings)
    summary = bench.summary(r)

    cache_aware, round_robin = r["cache_aware"], r["round_robin"]
    assert cache_aware["failed"] == round_robin["failed"] == 0, summary
    assert cache_aware["later_turns"] == 3 * 3
    assert cache_aware["later_sticky_share"] == 1.0, summary  # every later turn on its prefix's replica
    assert cache_aware["later_hit_share"] == 1.0, summary  # ... with cached tokens
    assert cache_aware["hit_rate"] > round_robin["hit_rate"], summary
    assert len(round_robin["per_replica"]) == 2, summary  # both replicas served

    drain = r["drain"]
    assert drain["failed"] == 0, summary
    assert drain["drained_exit_code"] == 0, summary
    assert drain["sent_after_drain"] > 0 and drain["served_after_drain_by_drained"] == 0, summary

    kill = r["kill"]
    assert kill["sent_after_kill"] > 0, summary
    assert kill["failed_sent_after_kill"] == 0 and kill["served_after_kill_by_killed"] == 0, summary
    assert kill["failed"] == kill["failed_in_flight_at_kill"], summary  # only in-flight requests were lost
