"""What `ft serve` shows a person at its terminal: the loading bar and the ready block.

Owns `LoadBar` (one line on stderr, redrawn in place, while the engine process loads the model's
weights -- drawn only when stderr is a terminal, never in a log file, a pipe or a test's capture)
and `ready_block` (the lines logged once when the engine is first ready: the OpenAI and Anthropic
base URLs, the model name to send, a curl line to try, the `ft chat` / `ft launch` hints), with
`openable_host` turning a listening address such as 0.0.0.0 into one a browser or curl can open.

The bar is drawn by the API process, from the load progress the engine process puts in its
heartbeats (server/process/heartbeat.py), not by the engine process on the stderr it inherits:
the API process owns the terminal's other output (its own log lines, uvicorn's, the ready block,
the exit message), so one process decides when the bar is cleared -- before the ready block or a
start-up error, never left half a line under them; an engine restarted after a death draws no
second bar of its own, and tensor-parallel ranks none at all. The cost is the heartbeat's period
(0.5 s) as the bar's refresh, plenty for a load of seconds to minutes. It imports no web stack.
"""

from __future__ import annotations

import json
import shlex
import socket
import time
from collections.abc import Callable
from typing import IO

from freetoken.utils.logs import CLEAR_LINE, is_terminal
from freetoken.weights.sampling_defaults import SamplingDefaults

DEFAULT_URL = "http://127.0.0.1:1919"  # ft serve's default --host / --port, which ft chat and ft launch use
BAR_WIDTH = 24
GB = 1e9


def openable_host(host: str) -> str:
    """The host part of a URL that reaches a server listening on `host` from this machine: the
    loopback address for a wildcard (0.0.0.0, ::, empty), an IPv6 address in brackets."""
    if host in ("", "0.0.0.0"):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host


def is_wildcard(host: str) -> bool:
    return host in ("", "0.0.0.0", "::")


def base_url(host: str, port: int) -> str:
    return f"http://{openable_host(host)}:{port}"


def ready_block(
    served_name: str,
    host: str,
    port: int,
    *,
    architecture: str,
    context_length: int,
    api_key: bool,
    seconds: float,
    hostname: Callable[[], str] = socket.gethostname,
    sampling: SamplingDefaults | None = None,
    note: str | None = None,
) -> tuple[str, dict[str, object]]:
    """The ready block's text (its first line and indented lines under it) and its fields (for
    --log-format json). URLs are ones this machine can open; with a wildcard --host, also the
    machine's hostname for other machines. `note`: a last line about the model (a bundled base
    model is no chat model)."""
    url = base_url(host, port)
    body = json.dumps({"model": served_name, "messages": [{"role": "user", "content": "Hello!"}]})
    auth = ' -H "Authorization: Bearer $FT_API_KEY"' if api_key else ""
    curl = f"curl {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} -d {shlex.quote(body)}"
    at = "" if url == DEFAULT_URL else f" --url {url}"
    lines = [
        f"ready: {served_name} ({architecture}, context {context_length} tokens) in {seconds:.1f} s",
        f"OpenAI API     {url}/v1",
        f"Anthropic API  {url}  (POST /v1/messages)",
        f"model          {served_name}",
        f"try            {curl}",
        f"chat           ft chat{at}",
        f"coding agents  ft launch codex|claude|opencode{at}",
    ]
    fields: dict[str, object] = {
        "event": "ready",
        "model": served_name,
        "openai_base_url": f"{url}/v1",
        "anthropic_base_url": url,
        "context_length": context_length,
        "ready_s": round(seconds, 3),
    }
    if sampling is not None and sampling.values:
        lines.append(f"sampling       {sampling.describe()}, for fields a request leaves out")
        fields["sampling_defaults"] = dict(sampling.values)
    if api_key:
        lines.append("API key        required: the curl line reads it from $FT_API_KEY")
    if is_wildcard(host):
        other = f"http://{hostname()}:{port}"
        lines.append(f"network        listening on every interface: from other machines {other}/v1")
        fields["network_base_url"] = other
    if note is not None:
        lines.append(f"note           {note}")
        fields["note"] = note
    return "\n".join(lines), fields


class LoadBar:
    """`loading NAME [#####...]  42%  120/236 tensors  0.21/0.50 GB  3 s`, redrawn in place on
    `stream` as `update` is called (a start from the weight cache, which counts bytes only:
    `loading NAME [#####...]  42%  0.21/0.50 GB from the weight cache  3 s`); nothing at all when
    `stream` is not a terminal (`tty` overrides the check, for tests). `clear` erases it (before
    the ready block, at exit)."""

    def __init__(
        self, stream: IO[str], label: str, *, tty: bool | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.stream = stream
        self.label = label
        self.enabled = is_terminal(stream) if tty is None else tty
        self.clock = clock
        self.started: float | None = None
        self.drawn = False

    def text(self, tensors: int, tensors_total: int, done_bytes: int, total_bytes: int, seconds: float) -> str:
        share = done_bytes / total_bytes if total_bytes else tensors / tensors_total
        share = min(max(share, 0.0), 1.0)
        filled = int(share * BAR_WIDTH)
        bar = "#" * filled + "." * (BAR_WIDTH - filled)
        size = f"  {done_bytes / GB:.2f}/{total_bytes / GB:.2f} GB" if total_bytes else ""
        if tensors_total > 0:
            count, done = f"  {tensors}/{tensors_total} tensors{size}", tensors >= tensors_total
        else:  # the weight cache: its entry's bytes checked
            count, done = f"{size} from the weight cache", done_bytes >= total_bytes
        then = "; preparing the engine" if done else ""  # weights packed, KV memory allocated
        return f"loading {self.label} [{bar}] {share * 100:3.0f}%{count}  {seconds:.0f} s{then}"

    def update(self, tensors: int, tensors_total: int, done_bytes: int, total_bytes: int) -> None:
        """The engine's latest count (a heartbeat's); a count with no total yet draws nothing."""
        if not self.enabled or (tensors_total <= 0 and total_bytes <= 0):
            return
        now = self.clock()
        if self.started is None:
            self.started = now
        self.stream.write(CLEAR_LINE + self.text(tensors, tensors_total, done_bytes, total_bytes, now - self.started))
        self.stream.flush()
        self.drawn = True

    def clear(self) -> None:
        if self.drawn:
            self.stream.write(CLEAR_LINE)
            self.stream.flush()
            self.drawn = False
