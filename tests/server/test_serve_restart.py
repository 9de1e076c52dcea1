"""Killing the engine process under `ft serve`: /health goes non-200, an in-flight stream ends
with an error event (no hang, no [DONE]), then the supervisor's new engine serves again. Also:
the app module keeps torch out of the API process, and a model without a chat template says so.

No test depends on another's restarts (each counts its own, as a delta; both are marked
`expects_engine_restart` for the conftest's guard) or on catching the down window by polling
fast: the test that checks the 503s freezes (SIGSTOP) the supervisor's new engine process the
moment it is spawned, so the engine stays down until the test resumes it. Nor on speed: the
stream killed mid-way is held in the engine after its first token (`--test-hold`,
tests/server/hold.py), so it is still in flight at the SIGKILL however fast the machine."""

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
import pytest
from hold import EngineHold
from procs import RespawnFreezer
from serving import ServeProcess, serving

MODEL = "tiny-gemma"


@pytest.fixture(scope="module")
def own_hold(tmp_path_factory: pytest.TempPathFactory) -> EngineHold:
    return EngineHold(tmp_path_factory.mktemp("restart_hold") / "hold")


@pytest.fixture(scope="module")
def own_server(tiny_gemma_dir: Path, own_hold: EngineHold, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    flags = ["--page-size", "4", "--num-tokens", "2048", "--max-running-requests", "2", "--dtype", "float32", "--threads", "1",
             *own_hold.flags]
    with serving(str(tiny_gemma_dir), flags, tmp_path_factory.mktemp("restart_logs") / "restart.log") as proc:
        yield proc


def restarts_metric(server: ServeProcess) -> float:
    text = httpx.get(f"{server.base}/metrics", timeout=30).text
    return next(float(line.split()[1]) for line in text.splitlines() if line.startswith("freetoken_engine_restarts "))


@pytest.mark.expects_engine_restart
def test_engine_killed_mid_stream_then_back(own_server: ServeProcess, own_hold: EngineHold) -> None:
    healthy = own_server.wait_healthy()
    first_pid, restarts_before = healthy["pid"], healthy["restarts"]
    metric_before = restarts_metric(own_server)
    body = {"model": MODEL, "prompt": [5, 6, 7, 8], "max_tokens": 100, "temperature": 0, "ignore_eos": True, "stream": True}
    events: list[str] = []
    own_hold.decode_after(1)
    try:
        with httpx.Client(base_url=own_server.base, timeout=120) as c, c.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            for line in lines:
                if line.startswith("data: "):
                    events.append(line)
                    break
            os.kill(first_pid, signal.SIGKILL)  # the stream is held after its first token: still in flight
            for line in lines:  # must end (with an error event), not hang
                if line.startswith("data: "):
                    events.append(line)
    finally:
        own_hold.release()
    assert "data: [DONE]" not in events
    last = json.loads(events[-1][6:])
    assert "error" in last and last["error"]["message"], last
    deadline = time.monotonic() + 240
    health = httpx.get(f"{own_server.base}/health", timeout=30)
    while health.status_code != 200 and time.monotonic() < deadline:
        assert health.json()["status"] == "error" and health.json()["message"]
        time.sleep(0.2)
        health = httpx.get(f"{own_server.base}/health", timeout=30)
    assert health.status_code == 200 and health.json()["pid"] != first_pid, health.text
    assert health.json()["restarts"] == restarts_before + 1
    own_server.engine_pids.add(health.json()["pid"])
    r = httpx.post(f"{own_server.base}/v1/completions", json={"model": MODEL, "prompt": "back again", "max_tokens": 3}, timeout=120)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    assert restarts_metric(own_server) == metric_before + 1


@pytest.mark.expects_engine_restart
def test_health_is_503_while_engine_is_down(own_server: ServeProcess) -> None:
    healthy = own_server.wait_healthy()
    pid, restarts_before = healthy["pid"], healthy["restarts"]
    freezer = RespawnFreezer(own_server.proc.pid)
    freezer.start()
    try:
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 60  # a hang guard: the supervisor sees the death at once
        r = httpx.get(f"{own_server.base}/health", timeout=30)
        while r.status_code == 200 and r.json()["pid"] == pid and time.monotonic() < deadline:
            r = httpx.get(f"{own_server.base}/health", timeout=30)
        # Until the test resumes the frozen respawn, the engine cannot be back: only 503s here.
        assert r.status_code == 503, r.text
        assert r.json()["status"] == "error" and r.json()["message"]
        busy = httpx.post(f"{own_server.base}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1}, timeout=60)
        assert busy.status_code == 503, busy.text
        assert busy.json()["error"]["code"] == "engine_unavailable"
        assert freezer.caught.wait(60), "the supervisor never spawned a new engine"
        still_down = httpx.get(f"{own_server.base}/health", timeout=30)
        assert still_down.status_code == 503 and still_down.json()["status"] == "error", still_down.text
    finally:
        freezer.resume()
    back = own_server.wait_healthy()
    assert back["pid"] != pid and back["restarts"] == restarts_before + 1
    assert freezer.frozen is not None and freezer.frozen.pid == back["pid"], "the frozen child was not the new engine"
    own_server.engine_pids.add(back["pid"])


def test_app_import_keeps_torch_out() -> None:
    code = "import sys, freetoken.server.app, freetoken.server.serve; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=Path(__file__).resolve().parents[2])
    assert out.stdout.strip() == "False"


def test_model_without_chat_template_is_a_400(tmp_path: Path) -> None:
    from freetoken.server.errors import APIError
    from freetoken.server.core.chat_prompt import render_chat
    from freetoken.tokenizer import Tokenizer
    from freetoken.tokenizer.testing import write_tiny_tokenizer

    write_tiny_tokenizer(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer.from_pretrained_dir(tmp_path)
    with pytest.raises(APIError) as info:
        render_chat(tok, [{"role": "user", "content": "hi"}])
    assert info.value.status == 400 and info.value.code == "no_chat_template"
    tok.chat_template = "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}<|im_start|>"
    ids, boundaries = render_chat(tok, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}])
    assert boundaries and all(0 < b < len(ids) for b in boundaries) and list(boundaries) == sorted(boundaries)
