"""The real coding-agent CLIs against `ft serve` on the bundled Gemma 3 270M, non-interactively:
`codex exec` (Codex 0.171.0) and `claude -p` (Claude Code 2.1.332), each started by `ft launch`
as a user starts it (Codex's config.toml and Claude Code's environment are ft launch's) and asked
for one short answer; a turn is done when the CLI exits 0 having printed the model's text. Slow (minutes on 2 busy cores: ~6k and ~12k prompt
tokens, and a 270M model may write a long answer), so it runs only with `-m agent_cli`, and each
CLI is skipped unless installed: on PATH, or named by FT_CODEX_BIN / FT_CLAUDE_BIN, e.g.

    npm install --prefix /tmp/agentcli @openai/codex@0.171.0 @anthropic-ai/claude-code@2.1.332
    FT_CODEX_BIN=/tmp/agentcli/node_modules/.bin/codex \\
    FT_CLAUDE_BIN=/tmp/agentcli/node_modules/@anthropic-ai/claude-code-linux-x64/claude \\
    python -m pytest -q -m agent_cli tests/server/test_clients_agent_cli.py

The recipe is docs/agents.md's ("ft launch")."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest
from serving import ServeProcess, serving

pytestmark = pytest.mark.agent_cli
CONTEXT = 32768  # Claude Code's first prompt is ~12k Gemma tokens, and a reply cut at its 4096-token
# budget is continued in a second request of ~15.5k; Codex's first prompt is ~6k
RUN_DEADLINE_S = 1800  # a hang guard, nothing is timed


def asked_for(config: pytest.Config) -> bool:
    expr = str(config.getoption("markexpr") or "")
    return "agent_cli" in expr and "not agent_cli" not in expr


def cli(env_name: str, command: str) -> str:
    path = os.environ.get(env_name) or shutil.which(command)
    if not path:
        pytest.skip(f"{command} is not installed (npm install it and put it on PATH, or set {env_name}); see this module's docstring")
    return path


@pytest.fixture(scope="module")
def real_server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    if not asked_for(request.config):
        pytest.skip("slow: run with -m agent_cli")
    flags = ["--context-length", str(CONTEXT)]
    with serving("gemma3-270m", flags, tmp_path_factory.mktemp("agent_cli_logs") / "serve.log", deadline_s=900) as proc:
        yield proc


def run(cmd: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, env={**os.environ, **env}, cwd=cwd, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=RUN_DEADLINE_S, check=False)


def launch(agent: str, binary: str, server: ServeProcess, args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """`ft launch AGENT --url ... -- ARGS`, the command a user runs, with the installed CLI's
    directory first on PATH (ft launch finds the agent there)."""
    path = f"{Path(binary).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    cmd = [sys.executable, "-m", "freetoken.cli", "launch", agent, "--url", server.base, "--", *args]
    return run(cmd, {**env, "PATH": path}, cwd)


def test_codex_exec_completes_a_turn(real_server: ServeProcess, tmp_path: Path) -> None:
    codex = cli("FT_CODEX_BIN", "codex")
    home = tmp_path / "codex_home"
    out = launch("codex", codex, real_server, ["exec", "--skip-git-repo-check", "Reply with exactly one word: hello"],
                 {"CODEX_HOME": str(home)}, tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.strip(), out.stderr  # the model's final message
    config = tomllib.loads((home / "config.toml").read_text())  # what ft launch wrote, and Codex read
    assert config["model_provider"] == "freetoken" and config["model_context_window"] == CONTEXT
    assert config["model_providers"]["freetoken"]["base_url"] == f"{real_server.base}/v1"
    real_server.assert_balanced_idle()


def test_claude_print_completes_a_turn(real_server: ServeProcess, tmp_path: Path) -> None:
    claude = cli("FT_CLAUDE_BIN", "claude")
    env = {"CLAUDE_CONFIG_DIR": str(tmp_path / "claude_home")}  # the rest is ft launch's environment
    out = launch("claude", claude, real_server, ["-p", "Reply with exactly one word: hello", "--max-turns", "2"], env, tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.strip(), out.stderr
    assert f"ANTHROPIC_BASE_URL={real_server.base}" in out.stderr  # the plan ft launch printed
    real_server.assert_balanced_idle()
