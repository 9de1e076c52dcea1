"""The deployment files (docs/deploy.md): the Dockerfile, deploy/freetoken.service and
deploy/prometheus.yml are checked to start `ft serve` as written, without docker or systemd
running anything: the container's and the unit's command lines go through the real `ft` entry
point (`freetoken.cli.main`) up to the point where the server would start (the start itself is
replaced by a stand-in that records the resolved configuration), `systemd-analyze verify` checks
the unit where that binary exists, and the scrape config names `ft serve`'s address and path."""

from __future__ import annotations

import json
import logging
import re
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from freetoken import cli
from freetoken.utils import logs

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
UNIT = ROOT / "deploy" / "freetoken.service"
PROMETHEUS = ROOT / "deploy" / "prometheus.yml"


# -- Dockerfile ---------------------------------------------------------------------------------

def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order: comments dropped, `\\` continuations joined."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue  # a comment inside a continued instruction
        if line.endswith("\\"):
            pending += line[:-1].rstrip() + " "
            continue
        line, pending = pending + line, ""
        keyword, _, args = line.partition(" ")
        out.append((keyword.upper(), args.strip()))
    assert not pending, "the Dockerfile ends inside a continued line"
    return out


def exec_form(args: str) -> list[str]:
    """ENTRYPOINT / CMD arguments: the exec (JSON) form only, so no shell stands between the
    container's stop signal and `ft serve`'s drain."""
    value = json.loads(args)
    assert isinstance(value, list) and all(isinstance(a, str) for a in value), args
    return value


def docker_argv(instructions: list[tuple[str, str]]) -> list[str]:
    """The command the container runs: the last ENTRYPOINT followed by the last CMD (Docker's rule
    for exec forms)."""
    entry = [exec_form(a) for k, a in instructions if k == "ENTRYPOINT"]
    cmd = [exec_form(a) for k, a in instructions if k == "CMD"]
    return (entry[-1] if entry else []) + (cmd[-1] if cmd else [])


class Started(Exception):
    """Raised by the stand-in for the server's start: the command got that far."""

    def __init__(self, engine: Any, server: Any) -> None:
        super().__init__("started")
        self.engine, self.server = engine, server


def run_ft_until_start(argv: list[str], monkeypatch: pytest.MonkeyPatch, env: dict[str, str] | None = None) -> Started:
    """`ft ARGV` through the real entry point, with the server's start replaced: returns what
    would have been started. A flag the parser refuses exits 2; a configuration that cannot work
    is one `ft serve: error:` line and a non-zero return: both fail here."""
    from freetoken.server import startup
    from freetoken.server.process import supervisor

    class NoEngine:  # `ft serve` starts its engine process before the checks: none here
        def abandon(self) -> None:
            pass

    def fake_start(engine_config: Any, server_config: Any, **_: Any) -> None:
        raise Started(engine_config, server_config)

    monkeypatch.setattr(startup, "start", fake_start)
    monkeypatch.setattr(supervisor.EarlyEngine, "start", staticmethod(lambda *args, **kwargs: NoEngine()))
    for name in ("FT_MODEL", "FT_HOST", "FT_PORT", "FT_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    for name, value in (env or {}).items():
        monkeypatch.setenv(name, value)
    assert argv[:1] == ["ft"], argv
    root = logging.getLogger()
    handlers, level, current = list(root.handlers), root.level, logs._current
    try:
        with pytest.raises(Started) as started:
            cli.main(argv[1:])
    finally:  # main() configures the root logger for the process: give pytest's back
        for handler in list(root.handlers):
            root.removeHandler(handler)
        for handler in handlers:
            root.addHandler(handler)
        root.setLevel(level)
        logs._current = current
    return started.value


def test_the_dockerfile_installs_the_checkout_and_serves_on_every_interface(monkeypatch: pytest.MonkeyPatch) -> None:
    ins = dockerfile_instructions(DOCKERFILE.read_text())
    keywords = [k for k, _ in ins]
    assert keywords[0] == "FROM" and re.fullmatch(r"python:3\.1[1-9][\w.-]*", ins[0][1]), ins[0]
    known = {"FROM", "RUN", "COPY", "ADD", "WORKDIR", "USER", "ENV", "EXPOSE", "STOPSIGNAL", "HEALTHCHECK",
             "ENTRYPOINT", "CMD", "ARG", "LABEL", "VOLUME", "SHELL"}
    assert set(keywords) <= known, set(keywords) - known
    assert ("COPY", ". .") in ins, "the image installs the checkout it is built from"
    copy_at = ins.index(("COPY", ". ."))
    installs = [i for i, (k, a) in enumerate(ins) if k == "RUN" and re.search(r"pip install\b[^&]*\s\.(\s|$)", a)]
    assert installs and installs[0] > copy_at, "`pip install .` after the checkout is copied"
    assert ("STOPSIGNAL", "SIGTERM") in ins, "SIGTERM is what drains ft serve"

    argv = docker_argv(ins)
    assert argv[:2] == ["ft", "serve"], argv
    started = run_ft_until_start(argv, monkeypatch)
    assert started.server.host == "0.0.0.0"
    port = started.server.port
    assert started.engine.model in (None, "gemma3-270m"), "the bundled model"
    assert ("EXPOSE", str(port)) in ins
    health = next(a for k, a in ins if k == "HEALTHCHECK")
    assert f"127.0.0.1:{port}/health" in health


def test_the_dockerfile_parser_sees_continuations_and_exec_forms() -> None:
    ins = dockerfile_instructions('FROM x\n# c\nRUN a \\\n  # inside\n  && b\nCMD ["ft", "serve"]\n')
    assert ins == [("FROM", "x"), ("RUN", "a && b"), ("CMD", '["ft", "serve"]')]
    assert docker_argv([("ENTRYPOINT", '["ft", "serve"]'), ("CMD", '["m.gguf"]')]) == ["ft", "serve", "m.gguf"]
    with pytest.raises(json.JSONDecodeError):
        exec_form("ft serve")  # the shell form is refused


# -- systemd unit -------------------------------------------------------------------------------

def unit_sections(text: str) -> dict[str, list[tuple[str, str]]]:
    sections: dict[str, list[tuple[str, str]]] = {}
    current = None
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], [])
            continue
        assert current is not None, f"a setting outside a section: {line}"
        key, sep, value = line.partition("=")
        assert sep, f"not KEY=VALUE: {line}"
        current.append((key.strip(), value.strip()))
    return sections


def exec_start_argv(sections: dict[str, list[tuple[str, str]]]) -> list[str]:
    """ExecStart split as systemd does, `${VAR}` replaced from the unit's Environment= lines."""
    service = sections["Service"]
    env: dict[str, str] = {}
    for key, value in service:
        if key == "Environment":
            for item in shlex.split(value):
                name, _, val = item.partition("=")
                env[name] = val
    (line,) = [v for k, v in service if k == "ExecStart"]
    return [re.sub(r"\$\{(\w+)\}", lambda m: env[m.group(1)], word) for word in shlex.split(line)]


def test_the_systemd_unit_runs_ft_serve(monkeypatch: pytest.MonkeyPatch) -> None:
    sections = unit_sections(UNIT.read_text())
    assert {"Unit", "Service", "Install"} <= set(sections)
    service = dict(sections["Service"])
    argv = exec_start_argv(sections)
    assert Path(argv[0]).is_absolute() and Path(argv[0]).name == "ft" and argv[1] == "serve", argv
    started = run_ft_until_start(["ft", *argv[1:]], monkeypatch)
    assert (started.server.host, started.server.port) == (cli.DEFAULT_HOST, cli.DEFAULT_PORT)
    assert started.engine.model == "gemma3-270m"
    assert service["KillSignal"] == "SIGTERM"
    assert service["RestartPreventExitStatus"] == "2", "exit 2 is a configuration a restart cannot fix"
    timeout = float(service["TimeoutStopSec"])
    assert timeout > 30, "longer than ft serve's default --shutdown-timeout (30 s), or the drain is cut short"


def test_systemd_analyze_verifies_the_unit(tmp_path: Path) -> None:
    """`systemd-analyze verify` where it exists (it checks that ExecStart's binary exists, so a
    stand-in executable takes the install path's place); elsewhere the ExecStart test above is
    the check."""
    analyze = shutil.which("systemd-analyze")
    text = UNIT.read_text()
    argv = exec_start_argv(unit_sections(text))
    if analyze is None:
        assert argv[1] == "serve"
        return
    stand_in = tmp_path / "ft"
    stand_in.write_text("#!/bin/sh\nexit 0\n")
    stand_in.chmod(0o755)
    unit = tmp_path / "freetoken.service"
    unit.write_text(text.replace(argv[0], str(stand_in)))
    out = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True, timeout=60)
    lines = [line for line in (out.stdout + out.stderr).splitlines() if "freetoken.service" in line]
    assert out.returncode == 0 and not lines, out.stdout + out.stderr


# -- Prometheus ---------------------------------------------------------------------------------

def test_the_prometheus_config_scrapes_ft_serves_metrics() -> None:
    config = yaml.safe_load(PROMETHEUS.read_text())
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "freetoken"]
    assert job.get("metrics_path", "/metrics") == "/metrics"
    assert job.get("scheme", "http") == "http"
    targets = [t for group in job["static_configs"] for t in group["targets"]]
    assert f"{cli.DEFAULT_HOST}:{cli.DEFAULT_PORT}" in targets
    from freetoken.server.admin import routes

    assert '"/metrics"' in Path(routes.__file__).read_text(), "the route the config scrapes"
