"""One log format for every process (utils/logs.py): a timestamped text line or a JSON object,
`-v` and `--log-format` before or after the subcommand, and a terminal's line cleared first (the
loading bar). Streams are injected: a StringIO, or one that says it is a terminal."""

from __future__ import annotations

import io
import json
import logging
import re
from collections.abc import Iterator

import pytest

from freetoken.cli import build_parser
from freetoken.utils import logs


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture(autouse=True)
def _restore_root_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level, settings = list(root.handlers), root.level, logs.current()
    yield
    for h in list(root.handlers):
        root.removeHandler(h)
    for h in handlers:
        root.addHandler(h)
    root.setLevel(level)
    logs._current = settings


def test_text_lines_carry_a_timestamp_level_process_and_logger() -> None:
    out = io.StringIO()
    logs.configure(logs.LogSettings(), "api", out)
    logging.getLogger("freetoken.server").info("listening on %s", "127.0.0.1:1919")
    logging.getLogger("uvicorn.error").info("Started server process [1]")  # uvicorn's own lines: the same format
    logging.getLogger("freetoken.x").debug("not at INFO")
    lines = out.getvalue().splitlines()
    assert len(lines) == 2, lines
    stamp = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3}"
    assert re.fullmatch(stamp + r" INFO  api    freetoken\.server: listening on 127\.0\.0\.1:1919", lines[0]), lines[0]
    assert re.fullmatch(stamp + r" INFO  api    uvicorn\.error: Started server process \[1\]", lines[1]), lines[1]
    assert "\r" not in out.getvalue()  # not a terminal: no line clearing


def test_verbose_logs_debug_and_a_multi_line_message_is_indented() -> None:
    out = io.StringIO()
    logs.configure(logs.LogSettings(verbose=True), "engine", out)
    logging.getLogger("freetoken.engine").debug("first\nsecond")
    first, second = out.getvalue().splitlines()
    assert first.endswith("DEBUG engine freetoken.engine: first") and second == "  second"


def test_on_a_terminal_each_line_clears_the_line_it_starts_on() -> None:
    out = FakeTTY()
    logs.configure(logs.LogSettings(), "api", out)
    logging.getLogger("freetoken").warning("careful")
    assert out.getvalue().startswith(logs.CLEAR_LINE) and out.getvalue().rstrip().endswith("careful")


def test_json_lines_are_objects_with_the_extra_fields() -> None:
    out = io.StringIO()
    logs.configure(logs.LogSettings(format="json"), "api", out)
    logging.getLogger("freetoken.requests").info("chat 200 ...", extra={"route": "chat", "prompt_tokens": 12,
                                                                      "color_message": "\x1b[1mchat\x1b[0m"})  # uvicorn's: dropped
    try:
        raise ValueError("boom")
    except ValueError:
        logging.getLogger("freetoken").exception("failed")
    first, second = (json.loads(line) for line in out.getvalue().splitlines())
    assert first["level"] == "INFO" and first["process"] == "api" and first["logger"] == "freetoken.requests"
    assert first["message"] == "chat 200 ..." and first["route"] == "chat" and first["prompt_tokens"] == 12
    assert "color_message" not in first
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", first["ts"]) and isinstance(first["pid"], int)
    assert second["level"] == "ERROR" and "ValueError: boom" in second["exception"]


def test_configure_replaces_the_handlers_and_is_remembered_for_child_processes() -> None:
    logging.basicConfig()
    logs.configure(logs.LogSettings(verbose=True, format="json"), "api", io.StringIO())
    assert len(logging.getLogger().handlers) == 1
    assert logs.current() == logs.LogSettings(verbose=True, format="json")
    with pytest.raises(ValueError, match="--log-format must be one of text, json"):
        logs.configure(logs.LogSettings(format="xml"), "api", io.StringIO())


@pytest.mark.parametrize("argv", [
    ["-v", "serve"], ["serve", "-v"], ["serve", "--verbose", "--port", "8000"], ["--log-format", "json", "serve", "-v"],
])
def test_verbose_is_taken_before_or_after_the_subcommand(argv: list[str]) -> None:
    assert build_parser().parse_args(argv).verbose is True


def test_log_format_before_or_after_the_subcommand_and_strict_about_values(capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser()
    assert parser.parse_args(["serve"]).log_format == "text" and parser.parse_args(["serve"]).verbose is False
    assert parser.parse_args(["--log-format", "json", "serve"]).log_format == "json"
    assert parser.parse_args(["serve", "--log-format", "json"]).log_format == "json"
    assert parser.parse_args(["generate", "hi", "-v"]).verbose is True
    with pytest.raises(SystemExit) as exit_:
        parser.parse_args(["serve", "--log-format", "xml"])
    assert exit_.value.code == 2 and "--log-format: invalid choice: 'xml'" in capsys.readouterr().err
