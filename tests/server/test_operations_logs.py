"""`ft serve`'s output as an operator reads it (a log file, not a terminal): one timestamped
format for the API process, uvicorn and the engine process; no loading bar; one ready block
with URLs that open; one line per request; `-v` after the subcommand reaching the engine, and
`--log-format json` giving one JSON object per line. Deadlines are hang guards, nothing is timed."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
from serving import serving

FLAGS = ["--threads", "1", "--dtype", "float32", "--num-tokens", "2048", "--max-running-requests", "4"]
STAMP = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} (DEBUG|INFO |WARNING|ERROR|CRITICAL) (api|engine) +\S+: ")


def chat(base: str, rid: str, stream: bool = False) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": stream}
    r = httpx.post(f"{base}/v1/chat/completions", json=body, headers={"x-request-id": rid}, timeout=120)
    assert r.status_code == 200, r.text


def test_text_logs_one_format_ready_block_and_request_lines(tiny_gemma_dir: Path, tmp_path: Path) -> None:
    log_path = tmp_path / "serve.log"
    with serving(str(tiny_gemma_dir), ["--served-model-name", "tiny", "-v", *FLAGS], log_path) as proc:
        chat(proc.base, "rid-plain")
        chat(proc.base, "rid-stream", stream=True)
        bad = httpx.post(f"{proc.base}/v1/chat/completions", json={"model": "other", "messages": []}, headers={"x-request-id": "rid-bad"},
                         timeout=60)
        assert bad.status_code in (400, 404)
    text = log_path.read_text()
    assert "\r" not in text and "tensors" not in text  # not a terminal: no loading bar
    assert "Uvicorn running on" not in text  # it came before the model was ready
    lines = [line for line in text.splitlines() if line.strip()]
    heads = [line for line in lines if not line.startswith("  ")]  # a multi-line record's continuations are indented
    assert all(STAMP.match(line) for line in heads), [line for line in heads if not STAMP.match(line)]
    assert any(" api    uvicorn.error: " in line for line in heads)  # uvicorn's own lines, in the same format
    assert any(" DEBUG engine freetoken.engine: engine process" in line for line in heads)  # -v after serve reached the engine
    ready = [i for i, line in enumerate(lines) if "freetoken.server: ready: tiny (gemma3, context" in line]
    assert len(ready) == 1, text
    block = lines[ready[0] + 1 : ready[0] + 7]
    assert f"  OpenAI API     {proc.base}/v1" in block and f"  Anthropic API  {proc.base}  (POST /v1/messages)" in block
    assert "  model          tiny" in block and any(line.startswith(f"  try            curl {proc.base}/v1/chat/completions") for line in block)
    assert f"  coding agents  ft launch codex|claude|opencode --url {proc.base}" in block
    assert ready[0] > max(i for i, line in enumerate(lines) if " engine " in line and "KV pools" in line)  # after the engine is ready
    requests = [line.split("freetoken.requests: ", 1)[1] for line in heads if "freetoken.requests: " in line]
    plain = next(r for r in requests if "id=rid-plain/" in r or "id=rid-plain " in r)
    assert re.fullmatch(r"chat 200 id=rid-plain\S* prompt=\d+ cached=\d+ generated=[1-4] ttft=\d+\.\d{3}s tok/s=(\d+\.\d|-) "
                        r"finish=(stop|length)", plain), plain
    assert any(r.startswith("chat 200 id=rid-stream") for r in requests), requests
    assert any(r.startswith(("chat 400 id=rid-bad", "chat 404 id=rid-bad")) and "error=" in r for r in requests), requests


def test_json_logs_are_one_object_per_line(tiny_gemma_dir: Path, tmp_path: Path) -> None:
    log_path = tmp_path / "serve.log"
    with serving(str(tiny_gemma_dir), ["--served-model-name", "tiny", "--log-format", "json", *FLAGS], log_path) as proc:
        chat(proc.base, "rid-json")
    records = [json.loads(line) for line in log_path.read_text().splitlines() if line.strip()]
    assert {r["process"] for r in records} >= {"api", "engine"}
    assert any(r["logger"] == "uvicorn.error" for r in records)
    ready = [r for r in records if r.get("event") == "ready"]
    assert len(ready) == 1 and ready[0]["openai_base_url"] == f"{proc.base}/v1" and ready[0]["model"] == "tiny"
    request = next(r for r in records if r.get("event") == "request")
    assert request["route"] == "chat" and request["status"] == 200 and request["request_id"].startswith("rid-json")
    assert request["generated_tokens"] >= 1 and request["finish_reason"] in ("stop", "length") and request["ttft_s"] > 0
