"""`ft serve`'s output as an operator reads it (a log file, not a terminal): one timestamped
format for the API process, uvicorn and the engine process; no loading bar; one ready block
with URLs that open; one line per request, on every route but the polled ones; `-v` after the subcommand reaching the engine, and
`--log-format json` giving one JSON object per line. Deadlines are hang guards, nothing is timed."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
from serving import serving

FLAGS = ["--threads", "1", "--dtype", "float32", "--num-tokens", "2048", "--max-running-requests", "4"]
STAMP = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} (DEBUG|INFO |WARNING|ERROR|CRITICAL) (api|engine) +\S+: ")


def chat(base: str, rid: str, stream: bool = False, key: str | None = None) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": stream}
    auth = {} if key is None else {"Authorization": f"Bearer {key}"}
    r = httpx.post(f"{base}/v1/chat/completions", json=body, headers={"x-request-id": rid, **auth}, timeout=120)
    assert r.status_code == 200, r.text


def test_text_logs_one_format_ready_block_and_request_lines(tiny_gemma_dir: Path, tmp_path: Path) -> None:
    log_path = tmp_path / "serve.log"
    with serving(str(tiny_gemma_dir), ["--served-model-name", "tiny", "-v", *FLAGS], log_path) as proc:
        chat(proc.base, "rid-plain")
        chat(proc.base, "rid-stream", stream=True)
        bad = httpx.post(f"{proc.base}/v1/chat/completions", json={"model": "other", "messages": []}, headers={"x-request-id": "rid-bad"},
                         timeout=60)
        assert bad.status_code in (400, 404)
        others = {  # routes that generate nothing get their line too; health checks and the dashboard's polls none
            "rid-tok": ("POST", "/v1/tokenize", {"prompt": "hello there"}),
            "rid-count": ("POST", "/v1/messages/count_tokens", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}),
            "rid-tok-bad": ("POST", "/v1/tokenize", {"prompt": "x", "messages": []}),
            "rid-models": ("GET", "/v1/models", None),
            "rid-nowhere": ("GET", "/v1/nowhere", None),
            "rid-health": ("GET", "/health", None),
            "rid-activity": ("GET", "/admin/activity", None),
        }
        answers = {rid: httpx.request(method, f"{proc.base}{path}", json=body, headers={"x-request-id": rid}, timeout=60)
                   for rid, (method, path, body) in others.items()}
        assert [answers[rid].status_code for rid in others] == [200, 200, 400, 200, 404, 200, 200]
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
    by_id = {rid: [r for r in requests if f" id={rid} " in r + " "] for rid in others}
    assert all(len(by_id[rid]) == 1 for rid in others if rid not in ("rid-health", "rid-activity")), by_id  # one each
    assert by_id["rid-health"] == by_id["rid-activity"] == []
    assert by_id["rid-tok"] == [f"tokenize 200 id=rid-tok prompt={len(answers['rid-tok'].json()['tokens'])}"]
    assert by_id["rid-count"] == [f"count_tokens 200 id=rid-count prompt={answers['rid-count'].json()['input_tokens']}"]
    assert by_id["rid-tok-bad"] == ["tokenize 400 id=rid-tok-bad error=\"send exactly one of 'prompt' and 'messages'\""]
    assert by_id["rid-models"] == ["GET /v1/models 200 id=rid-models"]
    assert by_id["rid-nowhere"][0].startswith("GET /v1/nowhere 404 id=rid-nowhere error='Invalid URL")


def test_json_logs_are_one_object_per_line(tiny_gemma_dir: Path, tmp_path: Path) -> None:
    log_path = tmp_path / "serve.log"
    with serving(str(tiny_gemma_dir), ["--served-model-name", "tiny", "--log-format", "json", *FLAGS], log_path, api_key="k") as proc:
        chat(proc.base, "rid-json", key="k")
        keyless = httpx.post(f"{proc.base}/v1/chat/completions", json={}, headers={"x-request-id": "rid-nokey"}, timeout=60)
        assert keyless.status_code == 401  # refused before any route: its line comes from the middleware around the key check
        assert httpx.get(f"{proc.base}/health", headers={"x-request-id": "rid-health"}, timeout=60).status_code == 200
    records = [json.loads(line) for line in log_path.read_text().splitlines() if line.strip()]
    assert {r["process"] for r in records} >= {"api", "engine"}
    assert any(r["logger"] == "uvicorn.error" for r in records)
    ready = [r for r in records if r.get("event") == "ready"]
    assert len(ready) == 1 and ready[0]["openai_base_url"] == f"{proc.base}/v1" and ready[0]["model"] == "tiny"
    request = next(r for r in records if r.get("event") == "request")
    assert request["route"] == "chat" and request["status"] == 200 and request["request_id"].startswith("rid-json")
    assert request["generated_tokens"] >= 1 and request["finish_reason"] in ("stop", "length") and request["ttft_s"] > 0
    lines = [r for r in records if r.get("event") == "request"]
    nokey = [r for r in lines if r["request_id"] == "rid-nokey"]
    assert len(nokey) == 1 and nokey[0]["route"] == "POST /v1/chat/completions" and nokey[0]["status"] == 401
    assert nokey[0]["error"].startswith("a valid API key is required")
    assert not [r for r in lines if r["request_id"] == "rid-health"]  # health checks write no line
