"""`ft serve`'s options from the environment and files (cli.serve_options): FT_MODEL, FT_HOST,
FT_PORT and FT_API_KEY when no flag gives the value, --api-key-file, and a wrong value refused
naming the exact flag or variable; `--help` grouped with examples."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from freetoken.cli import build_parser, read_api_key_file, serve_options
from freetoken.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def options(argv: list[str], env: dict[str, str] | None = None) -> tuple[str | None, str, int, str | None]:
    return serve_options(build_parser().parse_args(["serve", *argv]), env or {})


def test_defaults_without_flags_or_environment() -> None:
    assert options([]) == (None, "127.0.0.1", 1919, None)


def test_the_environment_fills_what_no_flag_gives() -> None:
    env = {"FT_MODEL": "m.gguf", "FT_HOST": "0.0.0.0", "FT_PORT": "8000", "FT_API_KEY": "sk-env"}
    assert options([], env) == ("m.gguf", "0.0.0.0", 8000, "sk-env")


def test_flags_win_over_the_environment(tmp_path: Path) -> None:
    env = {"FT_MODEL": "env.gguf", "FT_HOST": "0.0.0.0", "FT_PORT": "8000", "FT_API_KEY": "sk-env"}
    assert options(["--model", "flag.gguf", "--host", "::1", "--port", "9000", "--api-key", "sk-flag"], env) == (
        "flag.gguf", "::1", 9000, "sk-flag")
    assert options(["pos.gguf", "--port", "0"], env)[:3] == ("pos.gguf", "0.0.0.0", 0)  # the MODEL argument is a flag too
    key = tmp_path / "key"
    key.write_text("sk-file\n")
    assert options(["--api-key-file", str(key)], env)[3] == "sk-file"


@pytest.mark.parametrize(("env", "needle"), [
    ({"FT_PORT": "http"}, "FT_PORT must be a port number in [0, 65535], got 'http'"),
    ({"FT_PORT": "70000"}, "FT_PORT must be a port number in [0, 65535], got '70000'"),
    ({"FT_PORT": "80.5"}, "FT_PORT must be a port number"),
    ({"FT_HOST": ""}, "FT_HOST is set but empty"),
    ({"FT_MODEL": " "}, "FT_MODEL is set but empty"),
    ({"FT_API_KEY": ""}, "FT_API_KEY is set but empty"),
])
def test_a_wrong_environment_value_is_refused_naming_the_variable(env: dict[str, str], needle: str) -> None:
    with pytest.raises(ConfigError) as err:
        options([], env)
    assert needle in str(err.value)


def test_a_flag_makes_its_variable_unread() -> None:
    assert options(["--port", "1234"], {"FT_PORT": "junk"})[2] == 1234


def test_the_api_key_file_is_strict(tmp_path: Path) -> None:
    empty, two, spaced = tmp_path / "empty", tmp_path / "two", tmp_path / "spaced"
    empty.write_text("\n")
    two.write_text("sk-a\nsk-b\n")
    spaced.write_text("sk a")
    for path, needle in ((empty, "is empty"), (two, "must hold the key alone"), (spaced, "must hold the key alone"),
                         (tmp_path / "missing", "cannot read")):
        with pytest.raises(ConfigError, match="^--api-key-file: ") as err:
            read_api_key_file(str(path))
        assert needle in str(err.value) and str(path) in str(err.value)
    ok = tmp_path / "ok"
    ok.write_text("  sk-123  \n")
    assert read_api_key_file(str(ok)) == "sk-123"
    with pytest.raises(ConfigError, match="--api-key and --api-key-file both give the key"):
        options(["--api-key", "a", "--api-key-file", str(ok)])


def test_a_wrong_environment_value_exits_2_with_one_line() -> None:
    out = subprocess.run([sys.executable, "-m", "freetoken.cli", "serve"], capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env={**__import__("os").environ, "FT_PORT": "eighty"})
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip() == "ft serve: error: FT_PORT must be a port number in [0, 65535], got 'eighty'"


def test_serve_help_is_grouped_with_examples_and_says_flags_win() -> None:
    helptext = subprocess.run([sys.executable, "-m", "freetoken.cli", "serve", "--help"], capture_output=True, text=True,
                              timeout=120, cwd=ROOT).stdout
    headings = [line.rstrip(":") for line in helptext.splitlines() if line.endswith(":") and not line.startswith(" ")]
    assert headings[:7] == ["options", "model", "server", "memory", "scheduling", "agents", "operations"], headings
    assert "environment (a flag, or the MODEL argument, wins over its variable):" in helptext
    for name in ("FT_MODEL", "FT_HOST", "FT_PORT", "FT_API_KEY", "examples:", "--api-key-file", "--log-format"):
        assert name in helptext
    groups = {g.title: {a.dest for a in g._group_actions} for g in _serve_parser()._action_groups}
    assert {"model_arg", "model"} <= groups["model"] and {"host", "port", "api_key", "api_key_file"} <= groups["server"]
    assert {"num_tokens", "context_length"} <= groups["memory"] and {"max_running_requests"} <= groups["scheduling"]
    assert {"tool_call_parser", "reasoning_parser"} <= groups["agents"] and {"verbose", "log_format"} <= groups["operations"]


def _serve_parser():  # type: ignore[no-untyped-def]
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    return sub.choices["serve"]  # type: ignore[attr-defined]


def test_the_flag_table_in_server_md_matches_serve_help() -> None:
    """Every option of `ft serve --help` is in docs/server.md's flag table, and the table names no
    option the parser lacks."""
    import re

    text = (ROOT / "docs" / "server.md").read_text()
    table = text.split("## Flags", 1)[1].split("\n\n", 2)[1]
    documented = set(re.findall(r"`(-{1,2}[a-z][a-z0-9-]*)", table))
    parser_flags = {s for a in _serve_parser()._actions for s in a.option_strings} - {"-h", "--help"}
    assert parser_flags - documented == set(), "in --help, not in docs/server.md"
    assert documented - parser_flags == set(), "in docs/server.md, not in --help"


def test_every_choice_of_a_serve_flag_is_in_its_server_md_row() -> None:
    """A flag's row in docs/server.md names every value `--help` offers (the row of
    `--reasoning-parser` once lacked `gemma4`)."""
    import re

    table = (ROOT / "docs" / "server.md").read_text().split("## Flags", 1)[1].split("\n\n", 2)[1]
    rows = {flag: row for row in table.splitlines() for flag in re.findall(r"`(-{1,2}[a-z][a-z0-9-]*)", row.split(" | ")[0])}
    missing = {}
    for action in _serve_parser()._actions:
        if not action.choices:
            continue
        row = rows[action.option_strings[0]]
        absent = [str(c) for c in action.choices if not re.search(rf"(?<![\w-]){re.escape(str(c))}(?![\w-])", row)]
        if absent:
            missing[action.option_strings[0]] = absent
    assert missing == {}, "values in --help, not in docs/server.md's row"
