"""What `ft serve` shows at a terminal (server/console.py): the loading bar, drawn only on a
terminal (a fake one here, and an injected clock), and the ready block with URLs that open."""

from __future__ import annotations

import io
import json
import shlex

from freetoken.server.console import LoadBar, base_url, openable_host, ready_block
from freetoken.utils.logs import CLEAR_LINE


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_wildcard_or_ipv6_host_becomes_an_address_that_opens() -> None:
    assert openable_host("0.0.0.0") == "127.0.0.1" and openable_host("") == "127.0.0.1"
    assert openable_host("::") == "[::1]" and openable_host("::1") == "[::1]" and openable_host("fe80::2") == "[fe80::2]"
    assert openable_host("10.1.2.3") == "10.1.2.3" and openable_host("box.local") == "box.local"
    assert base_url("0.0.0.0", 8000) == "http://127.0.0.1:8000"


def test_the_ready_block_names_the_urls_the_model_a_curl_line_and_the_agents() -> None:
    text, fields = ready_block("tiny", "127.0.0.1", 1919, architecture="gemma3", context_length=512, api_key=False, seconds=4.25)
    lines = text.splitlines()
    assert lines[0] == "ready: tiny (gemma3, context 512 tokens) in 4.2 s"
    assert "OpenAI API     http://127.0.0.1:1919/v1" in lines and "model          tiny" in lines
    assert "Anthropic API  http://127.0.0.1:1919  (POST /v1/messages)" in lines
    assert "coding agents  ft launch codex|claude|opencode" in lines and "chat           ft chat" in lines  # the default URL: no --url
    curl = shlex.split(next(line for line in lines if line.startswith("try ")).removeprefix("try").strip())
    assert curl[:2] == ["curl", "http://127.0.0.1:1919/v1/chat/completions"] and "Authorization" not in " ".join(curl)
    body = json.loads(curl[curl.index("-d") + 1])
    assert body["model"] == "tiny" and body["messages"][0]["role"] == "user"
    assert fields["openai_base_url"] == "http://127.0.0.1:1919/v1" and fields["anthropic_base_url"] == "http://127.0.0.1:1919"
    assert fields["model"] == "tiny" and "network_base_url" not in fields
    assert not any(line.startswith("sampling") for line in lines) and "sampling_defaults" not in fields


def test_the_ready_block_ends_with_a_note_about_the_model_when_there_is_one() -> None:
    text, fields = ready_block("m", "127.0.0.1", 1919, architecture="gemma3", context_length=512, api_key=False,
                               seconds=1.0, note="m is a base model")
    assert text.splitlines()[-1] == "note           m is a base model" and fields["note"] == "m is a base model"
    plain, plain_fields = ready_block("m", "127.0.0.1", 1919, architecture="gemma3", context_length=512, api_key=False, seconds=1.0)
    assert "note" not in plain and "note" not in plain_fields


def test_ready_block_names_the_models_sampling_defaults() -> None:
    from freetoken.weights.sampling_defaults import SamplingDefaults

    defaults = SamplingDefaults({"temperature": 0.6, "top_k": 20}, "generation_config.json")
    text, fields = ready_block("q", "127.0.0.1", 1919, architecture="qwen3", context_length=512, api_key=False, seconds=1.0,
                               sampling=defaults)
    assert "sampling       temperature 0.6, top_k 20 (generation_config.json), for fields a request leaves out" in text
    assert fields["sampling_defaults"] == {"temperature": 0.6, "top_k": 20}


def test_the_ready_block_on_every_interface_gives_urls_that_open_and_the_hostname() -> None:
    text, fields = ready_block("m'x", "0.0.0.0", 8000, architecture="llama", context_length=8192, api_key=True, seconds=1.0,
                               hostname=lambda: "gpu-box")
    assert "0.0.0.0" not in text
    assert "OpenAI API     http://127.0.0.1:8000/v1" in text
    assert "ft launch codex|claude|opencode --url http://127.0.0.1:8000" in text
    assert "from other machines http://gpu-box:8000/v1" in text and fields["network_base_url"] == "http://gpu-box:8000"
    curl = shlex.split(next(line for line in text.splitlines() if line.startswith("try ")).removeprefix("try").strip())
    assert "Authorization: Bearer $FT_API_KEY" in curl  # the key itself is never printed
    assert json.loads(curl[curl.index("-d") + 1])["model"] == "m'x"  # quoted for the shell


def test_no_bar_when_stderr_is_not_a_terminal() -> None:
    out = io.StringIO()
    bar = LoadBar(out, "tiny")
    bar.update(3, 10, 300, 1000)
    bar.clear()
    assert not bar.enabled and out.getvalue() == ""


def test_the_bar_is_redrawn_in_place_with_tensors_gb_and_time() -> None:
    out, now = FakeTTY(), [100.0]
    bar = LoadBar(out, "tiny", clock=lambda: now[0])
    bar.update(0, 0, 0, 0)  # no count yet: nothing
    assert out.getvalue() == ""
    bar.update(60, 240, 500_000_000, 2_000_000_000)
    now[0] = 112.0
    bar.update(120, 240, 1_000_000_000, 2_000_000_000)
    draws = out.getvalue().split(CLEAR_LINE)[1:]
    assert "\n" not in out.getvalue() and len(draws) == 2
    assert draws[0] == "loading tiny [######..................]  25%  60/240 tensors  0.50/2.00 GB  0 s"
    assert draws[1] == "loading tiny [############............]  50%  120/240 tensors  1.00/2.00 GB  12 s"
    bar.update(240, 240, 2_000_000_000, 2_000_000_000)  # every tensor read: the engine is set up next
    assert out.getvalue().endswith("100%  240/240 tensors  2.00/2.00 GB  12 s; preparing the engine")
    bar.clear()
    assert out.getvalue().endswith(CLEAR_LINE) and not bar.drawn
    bar.clear()  # nothing drawn: nothing written
    assert out.getvalue().count(CLEAR_LINE) == 4


def test_the_bar_counts_tensors_when_no_byte_total_is_known() -> None:
    out = FakeTTY()
    LoadBar(out, "m", clock=lambda: 0.0).update(1, 4, 0, 0)
    assert out.getvalue() == CLEAR_LINE + "loading m [######..................]  25%  1/4 tensors  0 s"


def test_a_start_from_the_weight_cache_draws_the_bytes_it_checks() -> None:
    out, now = FakeTTY(), [0.0]
    bar = LoadBar(out, "big", clock=lambda: now[0])
    bar.update(0, 0, 1_000_000_000, 4_000_000_000)
    now[0] = 3.0
    bar.update(0, 0, 4_000_000_000, 4_000_000_000)
    draws = out.getvalue().split(CLEAR_LINE)[1:]
    assert draws[0] == "loading big [######..................]  25%  1.00/4.00 GB from the weight cache  0 s"
    assert draws[1] == "loading big [########################] 100%  4.00/4.00 GB from the weight cache  3 s; preparing the engine"


def test_the_client_feeds_loading_beats_to_the_bar_and_the_503_reason_and_calls_on_ready(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """No engine process: the client's dispatch is handed encoded messages as the receiver would."""
    import asyncio

    from freetoken.config import EngineConfig
    from freetoken.server.process import client as client_module
    from freetoken.server.process.messages import Heartbeat, Ready, encode

    monkeypatch.setattr(client_module, "freeze_startup_heap", lambda: None)
    counts: list[tuple[int, int, int, int]] = []
    readies: list[Ready] = []

    async def scenario() -> None:
        c = client_module.EngineClient(EngineConfig(), served_name="m", on_load_progress=lambda *n: counts.append(n),
                                       on_ready=readies.append)
        c._set_loading("the engine is loading the model")
        c._dispatch(encode(Heartbeat(pid=7, phase="loading", steps=0)))  # no count yet (imports)
        assert c.reason == "the engine is loading the model" and counts == []
        c._dispatch(encode(Heartbeat(pid=7, phase="loading", steps=0, load_bytes=500_000_000, load_bytes_total=1_000_000_000)))
        assert counts == [(0, 0, 500_000_000, 1_000_000_000)]  # the weight cache: bytes checked, no tensors
        assert c.reason == "the engine is loading the model (0.50/1.00 GB of the weight cache read)"
        counts.clear()
        c._dispatch(encode(Heartbeat(pid=7, phase="loading", steps=0, load_tensors=5, load_tensors_total=10,
                                     load_bytes=250_000_000, load_bytes_total=1_000_000_000)))
        assert counts == [(5, 10, 250_000_000, 1_000_000_000)]
        assert c.reason == "the engine is loading the model (5/10 tensors, 0.25/1.00 GB read)"
        c._dispatch(encode(Ready("m", "llama", 100, 512, "radix", 16, 7)))
        assert c.state == "ready" and c.reason is None and [r.pid for r in readies] == [7]
        c._dispatch(encode(Heartbeat(pid=7, phase="serving", steps=3)))  # serving beats draw nothing
        assert len(counts) == 1

    asyncio.run(scenario())
