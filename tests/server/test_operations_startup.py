"""`ft serve` start-up as an operator meets it: a configuration the model's metadata already
refuses exits 2 with one line naming the flag before any engine process starts (no weights are
loaded), and a model whose weights cannot load exits 1 soon after the supervisor gives up, with
no child process left behind. Deadlines are generous hang guards, nothing is timed."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from serving import free_port

from freetoken.config import EngineConfig
from freetoken.errors import ConfigError, ModelLoadError
from freetoken.server.preflight import ModelFacts, facts_from_gguf, facts_from_hf, preflight

ROOT = Path(__file__).resolve().parents[2]
HANG_GUARD_S = 120


def serve(model: str, *flags: str, timeout: float = HANG_GUARD_S) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "freetoken.cli", "serve", "--model", model, "--port", str(free_port()),
           "--threads", "1", "--dtype", "float32", *flags]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def test_floor_refusal_exits_2_before_any_engine_starts(tiny_gemma_dir: Path) -> None:
    out = serve(str(tiny_gemma_dir), "--max-running-requests", "8", "--swa-full-tokens-ratio", "0.001")
    assert out.returncode == 2, out.stderr
    errors = [line for line in out.stderr.splitlines() if line.startswith("ft serve: error:")]
    assert len(errors) == 1 and "below its floor" in errors[0] and "--swa-full-tokens-ratio" in errors[0], out.stderr
    assert "engine process" not in out.stderr and "loading" not in out.stderr, out.stderr  # no engine, no weights


def test_contradictory_flags_exit_2_naming_them(tiny_gemma_dir: Path) -> None:
    out = serve(str(tiny_gemma_dir), "--swa-full-tokens-ratio", "0.5", "--swa-pool-tokens", "4096")
    assert out.returncode == 2 and "--swa-full-tokens-ratio and --swa-pool-tokens" in out.stderr, out.stderr
    out = serve(str(tiny_gemma_dir), "--engine-hang-timeout", "0.1")
    assert out.returncode == 2 and "--engine-hang-timeout" in out.stderr, out.stderr
    out = serve(str(tiny_gemma_dir), "--load-timeout", "0")
    assert out.returncode == 2 and "--load-timeout must be at least" in out.stderr, out.stderr


def test_unloadable_weights_exit_1_after_giving_up(tiny_gemma_dir: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(tiny_gemma_dir, broken)
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    proc = subprocess.Popen(
        [sys.executable, "-m", "freetoken.cli", "serve", "--model", str(broken), "--port", str(free_port()), "--threads", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
    )
    ps = psutil.Process(proc.pid)
    try:
        log, _ = proc.communicate(timeout=HANG_GUARD_S)  # it used to run forever here
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, log
    assert "giving up" in log and "ft serve: error:" in log and "not restarting" in log, log
    with pytest.raises(psutil.NoSuchProcess):
        ps.children()  # the process is gone, and its engine with it (the engine died first)


def test_preflight_reads_facts_from_metadata() -> None:
    gguf = {"general.architecture": "gemma3", "gemma3.context_length": 32768, "gemma3.attention.sliding_window": 512}
    assert facts_from_gguf(gguf) == ModelFacts(32768, 512)
    assert facts_from_gguf({"general.architecture": "llama", "llama.context_length": 4096}) == ModelFacts(4096, None)
    assert facts_from_hf({"model_type": "gemma3", "text_config": {"max_position_embeddings": 8192, "sliding_window": 64}}) == ModelFacts(8192, 64)
    assert facts_from_hf({"model_type": "llama", "max_position_embeddings": 4096}) == ModelFacts(4096, None)
    full_only = {"model_type": "gemma3_text", "layer_types": ["full_attention"] * 2, "sliding_window": 64}
    assert facts_from_hf(full_only) == ModelFacts(131_072, None)
    # Qwen2/3 write a window into every config.json; it counts only with use_sliding_window
    qwen = {"model_type": "qwen2", "max_position_embeddings": 32768, "sliding_window": 32768, "use_sliding_window": False}
    assert facts_from_hf(qwen) == ModelFacts(32768, None)
    assert facts_from_hf({**qwen, "model_type": "qwen3", "use_sliding_window": True, "sliding_window": 4096}) == ModelFacts(32768, 4096)
    assert facts_from_hf({"model_type": "mistral", "max_position_embeddings": 32768, "sliding_window": 4096}) == ModelFacts(32768, 4096)


def test_preflight_knows_gemma4() -> None:
    """Gemma 4 has sliding layers in both forms: its GGUF window is read, and its config.json (text
    or multimodal) is not refused as an unknown model_type."""
    gguf = {"general.architecture": "gemma4", "gemma4.context_length": 262_144, "gemma4.attention.sliding_window": 1024}
    assert facts_from_gguf(gguf) == ModelFacts(262_144, 1024)
    assert facts_from_hf({"model_type": "gemma4_text"}) == ModelFacts(131_072, 512)
    text = {"model_type": "gemma4_text", "max_position_embeddings": 262_144, "sliding_window": 1024}
    assert facts_from_hf({"model_type": "gemma4", "text_config": text}) == ModelFacts(262_144, 1024)
    with pytest.raises(ModelLoadError, match="unsupported model_type 'gemma4'"):
        facts_from_hf({"model_type": "gemma4"})  # multimodal without its text model


def test_preflight_refuses_what_the_engine_would() -> None:
    facts = ModelFacts(32768, 512)
    resolved = preflight(EngineConfig(max_running_requests=4), facts)
    assert resolved.swa_pages is not None and resolved.swa_floor is not None and resolved.swa_pages >= resolved.swa_floor
    with pytest.raises(ConfigError, match="below its floor"):
        preflight(EngineConfig(max_running_requests=8, swa_full_tokens_ratio=0.001), facts)
    with pytest.raises(ConfigError, match="--cache-type swa_radix"):
        preflight(EngineConfig(cache_type="swa_radix"), ModelFacts(4096, None))


def test_a_port_in_use_exits_2_naming_it_before_any_engine_starts(tiny_gemma_dir: Path) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cmd = [sys.executable, "-m", "freetoken.cli", "serve", "--model", str(tiny_gemma_dir), "--port", str(port),
               "--threads", "1", "--dtype", "float32"]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=HANG_GUARD_S, cwd=ROOT)
    assert out.returncode == 2, out.stderr
    errors = [line for line in out.stderr.splitlines() if line.startswith("ft serve: error:")]
    assert len(errors) == 1 and "--port" in errors[0] and f"{port} is already in use" in errors[0], out.stderr
    assert "engine process" not in out.stderr and "loading" not in out.stderr, out.stderr


def test_start_binds_the_port_and_abandon_frees_it(tiny_gemma_dir: Path) -> None:
    from freetoken.server.settings import ServerConfig
    from freetoken.server.startup import start

    engine = EngineConfig(model=str(tiny_gemma_dir), threads=1)
    started = start(engine, ServerConfig(port=0, served_model_name="tiny"), start_engine=False)
    port = started.sock.getsockname()[1]
    assert port != 0 and started.served_name == "tiny" and started.engine is None
    with pytest.raises(ConfigError, match=f"--port: 127.0.0.1:{port} is already in use"):
        start(engine, ServerConfig(port=port), start_engine=False)
    started.abandon()
    again = start(engine, ServerConfig(port=port), start_engine=False)  # free again
    assert again.served_name == tiny_gemma_dir.name
    again.abandon()
    # a refusal from the metadata comes before the port is taken
    with pytest.raises(ConfigError, match="--swa-full-tokens-ratio"):
        start(EngineConfig(model=str(tiny_gemma_dir), max_running_requests=8, swa_full_tokens_ratio=0.001),
              ServerConfig(port=port), start_engine=False)
    start(engine, ServerConfig(port=port), start_engine=False).abandon()


def test_the_first_steps_import_no_web_stack_and_no_torch() -> None:
    """`ft serve` starts the engine before FastAPI, uvicorn and torch are imported in the API process
    (their imports then overlap the engine's): a module that drags one in undoes that."""
    code = ("import sys, freetoken.cli, freetoken.server.startup, freetoken.distributed.checks; "
            "print(sorted(m for m in ('fastapi', 'starlette', 'uvicorn', 'torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_GUARD_S, cwd=ROOT)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr + out.stdout


def test_what_runs_before_the_engine_process_starts_imports_nothing_heavy() -> None:
    """`ft serve` starts the engine process right after reading its flags (cli.py), before the
    ~0.4 s of imports its checks need (gguf, numpy, zmq, the tokenizer): what it imports up to
    then must stay light, or the engine's ~3 s of torch imports start that much later."""
    code = ("import sys, freetoken.cli, freetoken.config, freetoken.server.process.supervisor, freetoken.weights.source; "
            "heavy = ('gguf', 'numpy', 'zmq', 'tokenizers', 'jinja2', 'pydantic', 'fastapi', 'uvicorn', 'torch'); "
            "print(sorted(m for m in heavy if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_GUARD_S, cwd=ROOT)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr + out.stdout
