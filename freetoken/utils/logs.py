"""One log format for every FreeToken process: `ft serve`'s API process (uvicorn's own lines
included), its engine process and its tensor-parallel ranks.

Owns `LogSettings` (level and `--log-format text|json`), `configure` (the root logger's one
handler on stderr, replacing whatever was there), the two formatters and `current` (what this
process was configured with, handed to the processes it starts, which configure themselves with
it). Text lines are `2026-01-02 03:04:05.678 INFO  api    freetoken.server: message`; JSON lines
are one object a line with `ts`, `level`, `process`, `pid`, `logger`, `message` and the fields a
call passes in `extra` (the request log line's numbers, the ready block's URLs). On a terminal a
text line first clears the line it starts on, so that a line written while the API process's
loading bar is drawn replaces the bar (redrawn with its next update) instead of running into it.
It imports nothing of FreeToken.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from dataclasses import dataclass
from typing import IO

FORMATS = ("text", "json")
CLEAR_LINE = "\r\x1b[K"  # carriage return, erase to the end of the line

# the attributes every LogRecord has: anything else on a record came in `extra`
# (and uvicorn's `color_message`, its message again with terminal colours)
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    "message",
    "asctime",
    "taskName",
    "color_message",
}


@dataclass(frozen=True)
class LogSettings:
    """How a process logs; picklable, so a process passes it to those it starts."""

    verbose: bool = False  # -v: DEBUG, else INFO
    format: str = "text"  # --log-format

    @property
    def level(self) -> int:
        return logging.DEBUG if self.verbose else logging.INFO


_current = LogSettings()


def current() -> LogSettings:
    """What `configure` was last called with in this process (the defaults before)."""
    return _current


def extra_fields(record: logging.LogRecord) -> dict[str, object]:
    """The fields a logging call passed in `extra`."""
    return {k: v for k, v in vars(record).items() if k not in _STANDARD and not k.startswith("_")}


class TextFormatter(logging.Formatter):
    """`date time.ms LEVEL process logger: message`; continuation lines of a multi-line message are
    indented by two spaces; `clear` prefixes each line with CLEAR_LINE (a terminal)."""

    def __init__(self, process: str, clear: bool = False) -> None:
        super().__init__()
        self.process = process
        self.clear = clear

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:  # noqa: N802 - logging's name
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(record.created)) + f".{int(record.msecs):03d}"

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        if record.exc_info:
            message += "\n" + self.formatException(record.exc_info)
        head = f"{self.formatTime(record)} {record.levelname:<5} {self.process:<6} {record.name}: "
        lines = message.split("\n")
        text = "\n".join([head + lines[0], *("  " + line for line in lines[1:])])
        return CLEAR_LINE + text if self.clear else text


class JSONFormatter(logging.Formatter):
    """One JSON object a line: ts (ISO 8601, UTC, ms), level, process, pid, logger, message, the
    record's `extra` fields, and `exception` when there is one."""

    def __init__(self, process: str) -> None:
        super().__init__()
        self.process = process

    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"
        doc: dict[str, object] = {
            "ts": ts,
            "level": record.levelname,
            "process": self.process,
            "pid": record.process,
            "logger": record.name,
            "message": record.getMessage(),
        }
        doc.update(extra_fields(record))
        if record.exc_info:
            doc["exception"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str)


def formatter(settings: LogSettings, process: str, stream: IO[str]) -> logging.Formatter:
    if settings.format == "json":
        return JSONFormatter(process)
    return TextFormatter(process, clear=is_terminal(stream))


def is_terminal(stream: IO[str]) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or closed
        return False


def configure(settings: LogSettings, process: str, stream: IO[str] | None = None) -> None:
    """The root logger: `settings.level`, one handler writing `settings.format` lines to `stream`
    (stderr) for `process` (`api`, `engine`, `rank1`, ...). Replaces the handlers already there
    (basicConfig's, a previous call's)."""
    global _current
    if settings.format not in FORMATS:
        raise ValueError(f"--log-format must be one of {', '.join(FORMATS)}, got {settings.format!r}")
    stream = stream if stream is not None else sys.stderr
    handler = logging.StreamHandler(stream)
    handler.setFormatter(formatter(settings, process, stream))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(settings.level)
    _current = settings
