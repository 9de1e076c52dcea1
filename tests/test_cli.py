"""`ft` as a user runs it: subprocesses, stdout/stderr and exit codes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tiny_models import write_tiny_model  # noqa: E402


def ft(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "freetoken.cli", *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model("gemma3", tmp_path_factory.mktemp("cli_tiny"))


def test_version_and_help_list_every_subcommand() -> None:
    out = ft("--version")
    assert out.returncode == 0 and out.stdout.startswith("freetoken ")
    helptext = ft("--help").stdout
    for sub in ("generate", "chat", "inspect", "serve"):
        assert sub in helptext


def test_generate_prints_only_the_completion(tiny_dir: Path) -> None:
    out = ft("generate", "--model", str(tiny_dir), "--max-tokens", "5", "--dtype", "float32", "hello")
    assert out.returncode == 0, out.stderr
    from freetoken.llm import LLM
    from freetoken.request import SamplingParams

    llm = LLM(str(tiny_dir), dtype="float32", max_running_requests=1)
    expected = llm.generate(["hello"], SamplingParams(max_tokens=5, temperature=0))[0].text
    assert out.stdout == expected + "\n"
    assert "loaded" in out.stderr  # logs go to stderr


def test_inspect_describes_layers_and_vocab(tiny_dir: Path) -> None:
    out = ft("inspect", "--model", str(tiny_dir))
    assert out.returncode == 0, out.stderr
    config = json.loads((tiny_dir / "config.json").read_text())
    assert "architecture:  gemma3" in out.stdout
    assert f"window:        {config['sliding_window']}" in out.stdout
    assert "SFSF" in out.stdout  # sliding pattern 2 over 4 layers
    assert "vocabulary:    320" in out.stdout
    assert "none (safetensors)" in out.stdout


def one_line_error(out: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert out.returncode != 0
    assert "Traceback" not in out.stderr
    errors = [line for line in out.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1, out.stderr
    for needle in needles:
        assert needle in errors[0], errors[0]


def test_bad_models_give_one_line_errors(tmp_path: Path, tiny_dir: Path) -> None:
    one_line_error(ft("generate", "--model", str(tmp_path / "nope.gguf"), "x"), "not found")
    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_bytes(b"GGUF" + b"\x00" * 20)
    one_line_error(ft("generate", "--model", str(corrupt), "x"), "corrupt.gguf")
    no_config = tmp_path / "noconfig"
    no_config.mkdir()
    (no_config / "tokenizer.json").write_text((tiny_dir / "tokenizer.json").read_text())
    one_line_error(ft("generate", "--model", str(no_config), "x"), "config.json")
    no_tok = tmp_path / "notok"
    no_tok.mkdir()
    (no_tok / "config.json").write_text((tiny_dir / "config.json").read_text())
    one_line_error(ft("generate", "--model", str(no_tok), "x"), "tokenizer.json")
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    for name in ("tokenizer.json", "model.safetensors"):
        (foreign / name).write_bytes((tiny_dir / name).read_bytes())
    (foreign / "config.json").write_text(json.dumps({"model_type": "mamba"}))
    one_line_error(ft("inspect", "--model", str(foreign)), "mamba")


def test_chat_without_a_server_is_one_line() -> None:
    import socket

    with socket.socket() as s:  # a port nothing listens on: bound, never listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        out = ft("chat", "--url", f"http://127.0.0.1:{port}", timeout=60)
    one_line_error(out, "cannot reach", str(port))
    assert out.returncode == 1


def test_serve_takes_vllm_spellings_of_its_flags() -> None:
    from freetoken.cli import build_parser

    vllm = build_parser().parse_args(["serve", "--max-model-len", "4096", "--max-num-seqs", "8", "--enable-auto-tool-choice"])
    ours = build_parser().parse_args(["serve", "--context-length", "4096", "--max-running-requests", "8"])
    assert (vllm.context_length, vllm.max_running_requests) == (ours.context_length, ours.max_running_requests) == (4096, 8)


def test_a_hub_id_is_refused_with_how_to_get_the_file() -> None:
    out = ft("serve", "--model", "Qwen/Qwen3-8B-GGUF", timeout=60)
    assert out.returncode == 1, out.stderr  # a model that cannot be loaded (a flag that cannot work is 2)
    error = [line for line in out.stderr.splitlines() if line.startswith("ft serve: error:")]
    assert len(error) == 1 and "looks like a Hugging Face id" in error[0] and "does not download" in error[0], out.stderr
    assert "hf download Qwen/Qwen3-8B-GGUF" in error[0]
    plain = ft("serve", "--model", "no-such-model.gguf", timeout=60)  # not an id: the plain message
    assert plain.returncode == 1 and "Hugging Face" not in plain.stderr and "model not found" in plain.stderr


def test_serve_takes_the_model_as_its_argument_too() -> None:
    from freetoken.cli import build_parser

    args = build_parser().parse_args(["serve", "some.gguf", "--port", "8000"])
    assert args.model_arg == "some.gguf" and args.model is None
    out = ft("serve", "a.gguf", "--model", "b.gguf", timeout=60)  # two different models: refused, naming both
    assert out.returncode == 2 and "'a.gguf'" in out.stderr and "--model 'b.gguf'" in out.stderr, out.stderr
    out = ft("serve", "Qwen/Qwen3-8B-GGUF", timeout=60)  # the positional form reaches the same model checks
    assert out.returncode == 1 and "looks like a Hugging Face id" in out.stderr, out.stderr


def test_generate_writes_each_piece_before_the_next_is_decoded(monkeypatch: pytest.MonkeyPatch) -> None:
    """`ft generate` streams: every piece is written and flushed to stdout before the engine is
    asked for the next one (the pieces come from a stand-in LLM whose stream records each request)."""
    import freetoken.llm
    from freetoken.cli import main

    events: list[str] = []

    class StubLLM:
        def __init__(self, *args: object, **kwargs: object) -> None:
            pass

        def stream(self, prompt: str, params: object):  # noqa: ANN201
            for piece in ("Once", " upon", " a time"):
                events.append(f"decode {piece!r}")
                yield piece

    class Recorder:
        def write(self, text: str) -> int:
            events.append(f"write {text!r}")
            return len(text)

        def flush(self) -> None:
            events.append("flush")

    monkeypatch.setattr(freetoken.llm, "LLM", StubLLM)
    monkeypatch.setattr(sys, "stdout", Recorder())
    assert main(["generate", "--model", "unused", "hello"]) in (0, None)
    assert events == [
        "decode 'Once'", "write 'Once'", "flush",
        "decode ' upon'", "write ' upon'", "flush",
        "decode ' a time'", "write ' a time'", "flush",
        "write '\\n'", "flush",
    ]  # fmt: skip
