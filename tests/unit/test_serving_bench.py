"""benchmarks/serving.py and peer.py: the statistics, the SSE folding and the result shape.

The whole benchmark (every scenario, quick settings) runs against a fake OpenAI-compatible server
behind httpx.MockTransport: no socket, no model, no timing asserted.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any, AsyncIterator

import httpx
import pytest


def _by_path(name: str) -> Any:
    """benchmarks/<name>.py loaded by path: putting benchmarks/ on sys.path would leave its
    `serving.py` ahead of tests/server's `serving` helper for every later test in this process."""
    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parents[2] / "benchmarks" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


peer = _by_path("peer")

# peer loads its sibling by path under this name (tests/server has a `serving` module of its own)
serving = sys.modules["bench_serving"]


def test_percentile_interpolates_between_ranks() -> None:
    xs = [4.0, 1.0, 3.0, 2.0]
    assert serving.percentile(xs, 0) == 1.0
    assert serving.percentile(xs, 50) == 2.5
    assert serving.percentile(xs, 100) == 4.0
    assert serving.percentile(list(range(101)), 99) == pytest.approx(99.0)
    assert serving.percentile([7.0], 99) == 7.0
    assert serving.percentile([], 50) is None
    assert serving.stats([0.001, 0.003], 1000.0) == {"n": 2, "mean": 2.0, "p50": 2.0, "p99": pytest.approx(2.98)}


def test_decode_rate_counts_tokens_after_the_first() -> None:
    s = serving.Stream(start=0.0, token_times=[0.5, 1.0, 1.5], end=1.6, completion_tokens=5)
    assert s.ttft == 0.5
    assert s.decode_rate == pytest.approx(4 / 1.0)  # 5 tokens in 3 chunks: the rate uses the usage count
    assert s.itls == [0.5, 0.5]
    assert serving.Stream(start=0.0, token_times=[0.5], end=0.6, completion_tokens=1).decode_rate is None


def test_events_fold_usage_and_llama_server_timings() -> None:
    s = serving.Stream(start=0.0)
    serving.add_event(s, {"choices": [{"delta": {"role": "assistant"}}]}, 0.1)  # no text: not a token
    serving.add_event(s, {"choices": [{"delta": {"content": "Hi"}}]}, 0.2)
    serving.add_event(s, {"choices": [{"text": " there"}]}, 0.3)
    serving.add_event(s, {"choices": [], "usage": {"completion_tokens": 2, "prompt_tokens": 9}, "timings": {"cache_n": 4}}, 0.4)
    assert (s.text, s.token_times, s.completion_tokens, s.prompt_tokens, s.cached_tokens) == ("Hi there", [0.2, 0.3], 2, 9, 4)
    with pytest.raises(serving.BenchError):
        serving.add_event(s, {"error": {"message": "engine down"}}, 0.5)


def fake_server() -> httpx.MockTransport:
    """Streams `max_tokens` one-token chunks; counts a token per word; reports half the chat prompt as cached."""

    async def sse(events: list[dict[str, Any]]) -> AsyncIterator[bytes]:
        for e in events:
            await asyncio.sleep(0.001)
            yield f"data: {json.dumps(e)}\n\n".encode()
        yield b"data: [DONE]\n\n"

    async def handler(request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "fake"}]})
        body = json.loads(request.content)
        if path == "/v1/tokenize":
            return httpx.Response(200, json={"tokens": [0] * len(body["prompt"].split())})
        assert body["model"] == "fake" and body["stream"] and body["ignore_eos"]
        chat = path == "/v1/chat/completions"
        prompt = sum(len(m["content"].split()) for m in body["messages"]) if chat else len(body["prompt"].split())
        pieces = [{"choices": [{"delta": {"content": "w "}} if chat else {"text": "w "}]} for _ in range(body["max_tokens"])]
        usage = {"completion_tokens": body["max_tokens"], "prompt_tokens": prompt}
        if chat:
            usage["prompt_tokens_details"] = {"cached_tokens": prompt // 2}
        return httpx.Response(200, content=sse([*pieces, {"choices": [], "usage": usage}]))

    return httpx.MockTransport(handler)


def test_every_scenario_against_a_fake_server(tmp_path: Path) -> None:
    s = dataclasses.replace(serving.quick(serving.Settings(base_url="http://fake")), progress=False, agent_duration_s=0.2, system_words=50)
    result = asyncio.run(serving.run(s, transport=fake_server()))
    json.dumps(result)  # the result file is plain JSON
    sc = result["scenarios"]
    assert result["meta"]["model"] == "fake" and set(sc) == set(serving.SCENARIOS)
    assert sc["single"]["greedy"]["completion_tokens"] == s.repeats * s.decode_tokens
    assert sc["single"]["sampled"]["sampling"] == {"temperature": 0.8, "top_p": 0.95}
    assert [r["concurrency"] for r in sc["sweep"]] == list(s.concurrency)
    assert all(r["total_tok_s"] > 0 and r["itl_ms"]["p99"] is not None for r in sc["sweep"])
    for row, length in zip(sc["prefill"], s.prefill_lengths):
        assert all(abs(n - length) <= max(2, length // 100) for n in row["counted_tokens"])
    agent = sc["agent"]
    assert agent["requests"] >= s.agent_conversations and agent["cached_share"] == pytest.approx(0.5, abs=0.05)
    table = peer.comparison(result, result)
    assert "| single stream greedy, tok/s |" in table and "| 1.00x |" in table
    assert "## fake" in serving.summary(result)


def test_plot_writes_a_png(tmp_path: Path) -> None:
    import matplotlib  # noqa: F401 - declared in [test]: missing is a failure, not a skip
    s = dataclasses.replace(serving.quick(serving.Settings(base_url="http://fake")), progress=False, scenarios=("sweep", "prefill"))
    result = asyncio.run(serving.run(s, transport=fake_server()))
    out = tmp_path / "x.png"
    serving.plot([result, result], str(out))
    assert out.read_bytes()[:4] == b"\x89PNG"


def test_plot_without_matplotlib_skips_with_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    serving.plot([], str(tmp_path / "x.png"))
    assert not (tmp_path / "x.png").exists()
    assert capsys.readouterr().err.count("\n") == 1


def test_paired_table_takes_the_median_of_per_round_ratios() -> None:
    """The paired rounds quote each round's ratio (FreeToken / llama-server), not a ratio of
    medians: a round where the machine was slow for both cancels out."""
    g, t = "single stream greedy, tok/s", "cold TTFT, 512-token prompt, s"
    rounds = [
        {"llama-server": {g: 100.0, t: 0.60}, "freetoken": {g: 120.0, t: 0.30}},
        {"llama-server": {g: 50.0, t: 1.20}, "freetoken": {g: 55.0, t: 0.48}},
        {"llama-server": {g: 80.0, t: 0.80}, "freetoken": {g: 104.0, t: 0.44}},
    ]
    lines = peer.paired_table(rounds).splitlines()
    assert lines[2] == "| single stream greedy, tok/s | 80.0 | 104.0 | 1.20x (1.10-1.30x) |"
    assert lines[3] == "| cold TTFT, 512-token prompt, s (lower is better) | 0.800 | 0.440 | 0.50x (0.40-0.55x) |"


def test_paired_measures_name_the_single_stream_and_prefill_figures() -> None:
    result = {"scenarios": {"single": {"greedy": {"decode_tok_s": 90.0}, "sampled": {"decode_tok_s": 80.0}},
                            "prefill": [{"prompt_tokens": 512, "ttft_s": 0.25}, {"prompt_tokens": 1024, "ttft_s": 0.5}]}}
    assert peer.paired_measures(result) == {
        "single stream greedy, tok/s": 90.0, "single stream sampled, tok/s": 80.0,
        "cold TTFT, 512-token prompt, s": 0.25, "cold TTFT, 1024-token prompt, s": 0.5,
    }
