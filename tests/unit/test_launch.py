"""`ft launch codex|claude|opencode` (freetoken/launch.py) against a small fake server on 127.0.0.1
that serves `/v1/models` and `/health`, with HOME / CODEX_HOME / XDG_CONFIG_HOME in tmp dirs and
fake agents (scripts first on PATH that record their argv and environment). What is checked is
what a user gets: the files parsed back (tomllib, json), the backups, the keys kept, the
environment and arguments the agent starts with, the exit codes. No real agent runs here
(tests/server/test_clients_agent_cli.py runs the real ones with -m agent_cli)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import tomllib
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from freetoken.cli import main
from freetoken.errors import ConfigError
from freetoken.launch import merge_codex_toml

CONTEXT = 32768
SERVED = "gemma3-270m"


class FakeServer:
    def __init__(self, key: str | None = None, context: int | None = CONTEXT) -> None:
        self.key = key
        self.context = context
        self.card_context: int | None = context  # what /v1/models says; /health says `context`
        self.loading = False  # /health 503, as while the engine loads
        self.auth: list[str | None] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                fake.auth.append(self.headers.get("Authorization"))
                if self.path == "/v1/models":
                    if fake.key and self.headers.get("Authorization") != f"Bearer {fake.key}":
                        return self.reply(401, {"error": {"message": "bad key"}})
                    card = {"id": SERVED, "object": "model", "owned_by": "freetoken", "max_model_len": fake.card_context}
                    return self.reply(200, {"object": "list", "data": [card]})
                if self.path == "/health" and fake.loading:
                    return self.reply(503, {"status": "error", "message": "engine loading"})
                if self.path == "/health":
                    return self.reply(200, {"status": "ok", "context_length": fake.context})
                return self.reply(404, {"error": {"message": "no such route"}})

            def reply(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server() -> Iterator[FakeServer]:
    s = FakeServer()
    yield s
    s.close()


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A HOME of the test's own, no agent on PATH, none of the variables that redirect configs."""
    home = tmp_path / "home"
    home.mkdir()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}/usr/bin{os.pathsep}/bin")
    for name in ("CODEX_HOME", "XDG_CONFIG_HOME", "FT_API_KEY", "ANTHROPIC_AUTH_TOKEN", "ANTHROPIC_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    return home


def fake_agent(home: Path, name: str, exit_code: int = 0) -> Path:
    """An executable `name` first on PATH that writes its argv and environment to a JSON file."""
    log = home.parent / f"{name}.json"
    script = home.parent / "bin" / name
    script.write_text(
        f"#!{sys.executable}\nimport json, os, sys\n"
        f"json.dump({{'argv': sys.argv[1:], 'env': dict(os.environ)}}, open({str(log)!r}, 'w'))\n"
        f"sys.exit({exit_code})\n"
    )
    script.chmod(0o755)
    return log


def backups(path: Path) -> list[Path]:
    return sorted(path.parent.glob(f"{path.name}.bak-*"))


EXISTING_CODEX = """# my settings
model = "gpt-5"
approval_policy = "on-request"

[model_providers.other]
name = "Other"
base_url = "https://example.invalid/v1"

[model_providers.freetoken]
name = "stale"
base_url = "http://127.0.0.1:9/v1"
wire_api = "chat"

[profiles.fast]
model = "o4-mini"
"""


def test_codex_config_merged_backed_up_and_args_passed(server: FakeServer, home: Path) -> None:
    config = home / ".codex" / "config.toml"
    config.parent.mkdir()
    config.write_text(EXISTING_CODEX)
    log = fake_agent(home, "codex")
    assert main(["launch", "codex", "--url", server.url + "/v1", "--", "exec", "--skip-git-repo-check", "say hi"]) == 0

    data = tomllib.loads(config.read_text())
    assert data["model"] == SERVED and data["model_provider"] == "freetoken"
    assert data["model_context_window"] == CONTEXT
    assert data["model_providers"]["freetoken"] == {
        "name": "FreeToken", "base_url": f"{server.url}/v1", "wire_api": "responses",
        "request_max_retries": 0, "stream_max_retries": 0,
    }
    # everything else kept, the comment too
    assert data["approval_policy"] == "on-request"
    assert data["model_providers"]["other"]["base_url"] == "https://example.invalid/v1"
    assert data["profiles"] == {"fast": {"model": "o4-mini"}}
    assert data["check_for_update_on_startup"] is False and data["analytics"] == {"enabled": False}
    assert config.read_text().startswith("# my settings\n")
    [backup] = backups(config)
    assert backup.read_text() == EXISTING_CODEX

    run = json.loads(log.read_text())
    assert run["argv"] == ["exec", "--skip-git-repo-check", "say hi"]
    assert "FREETOKEN_API_KEY" not in run["env"]  # no key: no env_key, nothing handed over

    # A second run changes nothing: no second backup, the same file.
    before = config.read_text()
    assert main(["launch", "codex", "--url", server.url]) == 0
    assert config.read_text() == before
    assert len(backups(config)) == 1


def test_codex_new_file_under_codex_home_with_a_key(server: FakeServer, home: Path, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    server.key = "sk-local-123"
    codex_home = home / "elsewhere"
    monkeypatch.setenv("CODEX_HOME", str(codex_home))
    monkeypatch.setenv("FT_API_KEY", "sk-local-123")
    log = fake_agent(home, "codex")
    assert main(["launch", "codex", "--url", server.url]) == 0
    data = tomllib.loads((codex_home / "config.toml").read_text())
    assert data["model_providers"]["freetoken"]["env_key"] == "FREETOKEN_API_KEY"
    assert "sk-local-123" not in (codex_home / "config.toml").read_text()
    assert not (home / ".codex").exists() and not backups(codex_home / "config.toml")
    run = json.loads(log.read_text())
    assert run["env"]["FREETOKEN_API_KEY"] == "sk-local-123" and run["env"]["CODEX_HOME"] == str(codex_home)
    assert server.auth[0] == "Bearer sk-local-123"
    err = capsys.readouterr().err
    assert "sk-local-123" not in err  # the printed plan hides it
    assert "    [analytics]\n    enabled = false\n" in err  # every line it added is shown, this table too


def test_the_printed_plan_leaves_out_an_analytics_table_the_file_has(server: FakeServer, home: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    config = home / ".codex" / "config.toml"
    config.parent.mkdir()
    config.write_text("[analytics]\nenabled = true\n")
    assert main(["launch", "codex", "--dry-run", "--url", server.url]) == 0
    assert "[analytics]" not in capsys.readouterr().out  # the user's own setting, kept and not FreeToken's


def test_claude_gets_its_environment_and_no_file(server: FakeServer, home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ANTHROPIC_AUTH_TOKEN", "users-own-token")
    log = fake_agent(home, "claude")
    assert main(["launch", "claude", "--url", server.url, "--model", "default", "--", "-p", "hello", "--max-turns", "2"]) == 0
    run = json.loads(log.read_text())
    env = run["env"]
    assert run["argv"] == ["-p", "hello", "--max-turns", "2"]
    assert env["ANTHROPIC_BASE_URL"] == server.url
    assert env["ANTHROPIC_API_KEY"]  # any string when the server has no key
    assert env["ANTHROPIC_MODEL"] == env["ANTHROPIC_DEFAULT_HAIKU_MODEL"] == env["ANTHROPIC_SMALL_FAST_MODEL"] == "default"
    assert env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] == "4096"  # docs/agents.md's value at a 32768 context
    assert env["CLAUDE_CODE_MAX_CONTEXT_TOKENS"] == str(CONTEXT)
    assert env["CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC"] == "1"
    assert "ANTHROPIC_AUTH_TOKEN" not in env
    assert list(home.iterdir()) == []  # nothing of Claude Code's written


def test_claude_output_budget_follows_the_context(home: Path) -> None:
    log = fake_agent(home, "claude")
    s = FakeServer(key="k", context=131072)
    try:
        assert main(["launch", "claude", "--url", s.url, "--api-key", "k"]) == 0
    finally:
        s.close()
    env = json.loads(log.read_text())["env"]
    assert env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] == "16384" and env["ANTHROPIC_API_KEY"] == "k"
    assert env["CLAUDE_CODE_MAX_CONTEXT_TOKENS"] == "131072"
    assert env["ANTHROPIC_MODEL"] == SERVED


def test_opencode_json_merged_under_xdg_config_home(server: FakeServer, home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    xdg = home / "xdg"
    config = xdg / "opencode" / "opencode.json"
    config.parent.mkdir(parents=True)
    existing = {"$schema": "https://opencode.ai/config.json", "theme": "tokyonight",
                "provider": {"other": {"npm": "@ai-sdk/openai-compatible", "options": {"baseURL": "http://x.invalid"}}}}
    config.write_text(json.dumps(existing))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(xdg))
    log = fake_agent(home, "opencode")
    assert main(["launch", "opencode", "--url", server.url, "--", "run", "hi"]) == 0
    data = json.loads(config.read_text())
    assert data["theme"] == "tokyonight" and data["provider"]["other"] == existing["provider"]["other"]
    provider = data["provider"]["freetoken"]
    assert provider["npm"] == "@ai-sdk/openai-compatible"
    assert provider["options"] == {"baseURL": f"{server.url}/v1"}
    assert provider["models"][SERVED]["limit"] == {"context": CONTEXT, "output": 4096}
    assert data["model"] == data["small_model"] == f"freetoken/{SERVED}"
    [backup] = backups(config)
    assert json.loads(backup.read_text()) == existing
    assert json.loads(log.read_text())["argv"] == ["run", "hi"]


@pytest.mark.parametrize("agent", ["codex", "claude", "opencode"])
def test_dry_run_writes_and_runs_nothing(agent: str, server: FakeServer, home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = fake_agent(home, agent)
    assert main(["launch", agent, "--dry-run", "--url", server.url, "--", "x"]) == 0
    out = capsys.readouterr().out
    assert "dry run" in out and SERVED in out and f"command: {agent} x" in out
    assert list(home.iterdir()) == [] and not log.exists()
    assert "not installed" not in out


@pytest.mark.parametrize(("agent", "package"), [("codex", "@openai/codex"), ("claude", "@anthropic-ai/claude-code"),
                                                 ("opencode", "opencode-ai")])
def test_a_dry_run_says_when_the_agent_is_not_installed(agent: str, package: str, server: FakeServer, home: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["launch", agent, "--dry-run", "--url", server.url]) == 0
    out = capsys.readouterr().out
    assert f"note: {agent} is not installed (not on PATH); install it with: npm install -g {package}" in out
    assert list(home.iterdir()) == []


@pytest.mark.parametrize(("agent", "package"), [("codex", "@openai/codex"), ("claude", "@anthropic-ai/claude-code"),
                                                 ("opencode", "opencode-ai")])
def test_missing_agent_says_how_to_install_after_writing(agent: str, package: str, server: FakeServer, home: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["launch", agent, "--url", server.url]) == 1
    err = capsys.readouterr().err
    assert f"npm install -g {package}" in err and "not installed" in err
    if agent == "codex":
        assert tomllib.loads((home / ".codex" / "config.toml").read_text())["model_provider"] == "freetoken"


def test_agent_exit_status_is_ft_launchs(server: FakeServer, home: Path) -> None:
    fake_agent(home, "codex", exit_code=3)
    with pytest.raises(SystemExit) as exc:
        main(["launch", "codex", "--url", server.url])
    assert exc.value.code == 3


def test_context_from_health_when_models_has_none(server: FakeServer, home: Path) -> None:
    server.card_context = None  # as while the engine has not said Ready
    server.context = 16384
    fake_agent(home, "codex")
    assert main(["launch", "codex", "--url", server.url]) == 0
    assert tomllib.loads((home / ".codex" / "config.toml").read_text())["model_context_window"] == 16384


def test_a_loading_server_is_an_error_before_anything_is_written(server: FakeServer, home: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    server.card_context = None
    server.loading = True
    assert main(["launch", "codex", "--url", server.url]) == 1
    assert "not ready (engine loading)" in capsys.readouterr().err
    assert not (home / ".codex").exists()


def test_server_errors_are_one_line(server: FakeServer, home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    server.key = "secret"
    assert main(["launch", "codex", "--url", server.url]) == 1
    err = capsys.readouterr().err
    assert "401" in err and "FT_API_KEY" in err
    server.key = None
    assert main(["launch", "codex", "--url", server.url, "--model", "gpt-5"]) == 2
    assert "gpt-5" in capsys.readouterr().err
    assert main(["launch", "codex", "--url", "127.0.0.1:1919"]) == 2
    assert "--url must be" in capsys.readouterr().err
    assert not (home / ".codex").exists()


def test_codex_merge_refuses_a_layout_it_would_break(tmp_path: Path) -> None:
    old = 'model_providers.freetoken.base_url = "http://x/v1"\n'
    with pytest.raises(ConfigError, match="add these lines yourself"):
        merge_codex_toml(old, {"model": "m", "model_provider": "freetoken"}, {"name": "FreeToken"}, tmp_path / "config.toml")


def test_ft_launch_as_a_command(server: FakeServer, home: Path) -> None:
    """The installed entry point: a subprocess, the agent's arguments untouched after `--`."""
    out = subprocess.run([sys.executable, "-m", "freetoken.cli", "launch", "codex", "--dry-run", "--url", server.url, "--", "--help"],
                         capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert out.returncode == 0, out.stderr
    assert "command: codex --help" in out.stdout and "wire_api = \"responses\"" in out.stdout


def test_unreadable_configs_are_left_alone(server: FakeServer, home: Path, monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    codex = home / ".codex" / "config.toml"
    codex.parent.mkdir()
    codex.write_text("model = \n")
    assert main(["launch", "codex", "--url", server.url]) == 2
    assert "not valid TOML" in capsys.readouterr().err
    opencode = home / ".config" / "opencode" / "opencode.json"
    opencode.parent.mkdir(parents=True)
    opencode.write_text('{\n  // mine\n  "theme": "x"\n}\n')
    assert main(["launch", "opencode", "--url", server.url]) == 2
    assert "not plain JSON" in capsys.readouterr().err
    assert codex.read_text() == "model = \n" and opencode.read_text().startswith("{\n  // mine")
    assert not backups(codex) and not backups(opencode)
