"""`ft chat`: an interactive, streamed chat in the terminal, as an HTTP client of `ft serve`.

Owns the REPL (`ChatREPL`: reading a possibly multi-line message, the slash commands, one turn
streamed from `/v1/chat/completions` and printed as it comes: reasoning dimmed, tool calls
shown), the conversation it keeps, the default transport (the standard library's `urllib`, so a
plain `pip install -e .` runs it; `httpx` is only a test extra) and, for `--model`, an `ft serve`
child on a free port of 127.0.0.1 (`ChildServer`). The chat template, the reasoning split, tool
call parsing and the streaming detokenizer are the server's: this module only speaks HTTP, so a
remote server and the child are the same code path.

Why a child server and not the in-process `LLM`: the offline API has no chat template, reasoning
parser, tool parser or streaming; the server has all four. In its own session (process group)
the child does not see the terminal's Ctrl-C, which cancels the turn here by closing the
connection -- the server then aborts the request and frees its KV pages.

I/O is injected (`input_fn`, `out`, `transport`) so tests drive the REPL without a terminal.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from freetoken.errors import FreeTokenError
from freetoken.utils.ports import free_port
from freetoken.weights.source import CHAT_MODEL, base_model_note

DEFAULT_URL = "http://127.0.0.1:1919"  # ft serve's default --host and --port
DIM = "\x1b[2m"
RESET = "\x1b[0m"
HELP = (
    'Enter sends. A line ending in \\ continues on the next line; a line that starts with """ opens a block\n'
    'that a line ending in """ closes. Ctrl-C cancels the answer being written (or the line being typed);\n'
    "Ctrl-D or /exit quits. Commands: /reset (forget the conversation), /system TEXT (set the system prompt;\n"
    "/system alone clears it), /save FILE (the conversation as JSON), /help, /exit. Start a message\n"
    "with // to send one that begins with /."
)

# A transport sends a chat-completions request body and yields the stream's chunks (the JSON of
# each `data:` event, `[DONE]` excluded). Closing the iterator must close the connection.
Transport = Callable[[dict[str, Any]], Iterator[dict[str, Any]]]


class ChatHTTPError(FreeTokenError):
    """The server answered with an error (HTTP status, or an error event in the stream)."""


def _error_message(body: bytes | str, status: int | None = None) -> str:
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
    try:
        err = json.loads(text).get("error")
        message = err.get("message") if isinstance(err, dict) else err
    except (ValueError, AttributeError):
        message = text.strip()[:500]
    return f"{status}: {message}" if status is not None else str(message)


@dataclass
class HTTPTransport:
    """`POST {url}/v1/chat/completions` with `stream: true`, read as server-sent events."""

    url: str = DEFAULT_URL
    api_key: str | None = None
    timeout_s: float = 600.0

    def _request(self, path: str, body: dict[str, Any] | None = None) -> urllib.request.Request:
        headers = {"Content-Type": "application/json"} if body is not None else {}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = json.dumps(body).encode() if body is not None else None
        return urllib.request.Request(self.url.rstrip("/") + path, data=data, headers=headers)

    def _open(self, req: urllib.request.Request) -> Any:
        try:
            return urllib.request.urlopen(req, timeout=self.timeout_s)  # noqa: S310 - the user's own server URL
        except urllib.error.HTTPError as err:
            raise ChatHTTPError(_error_message(err.read(), err.code)) from None
        except (urllib.error.URLError, OSError) as err:
            reason = getattr(err, "reason", err)
            raise FreeTokenError(
                f"cannot reach {self.url} ({reason}); is `ft serve` running? (or pass --model)"
            ) from None

    def models(self) -> list[str]:
        """The ids `/v1/models` lists (also the check that the server is there)."""
        with self._open(self._request("/v1/models")) as resp:
            return [m["id"] for m in json.loads(resp.read()).get("data", [])]

    def __call__(self, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        resp = self._open(self._request("/v1/chat/completions", body))
        try:
            while True:
                try:
                    raw = resp.readline()
                except (OSError, http.client.HTTPException) as err:  # timed out, or the server went away
                    raise ChatHTTPError(f"the stream broke off: {err!r}") from None
                if not raw:
                    raise ChatHTTPError("the stream ended without [DONE]")
                line = raw.decode("utf-8", "replace").strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    return
                try:
                    event = json.loads(data)
                except ValueError:
                    raise ChatHTTPError(f"not a JSON event: {data[:200]}") from None
                if "error" in event:
                    raise ChatHTTPError(_error_message(json.dumps(event)))
                yield event
        finally:
            resp.close()  # on Ctrl-C too: the server sees the disconnect and aborts the request


@dataclass
class ToolCall:
    id: str = ""
    name: str = ""
    arguments: str = ""

    def as_message(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class Turn:
    """What one streamed answer held."""

    content: str = ""
    reasoning: str = ""
    tool_calls: dict[int, ToolCall] = field(default_factory=dict)
    finish_reason: str | None = None

    def as_message(self) -> dict[str, Any]:
        content = self.content if self.content or not self.tool_calls else None
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if self.reasoning:
            message["reasoning_content"] = self.reasoning
        if self.tool_calls:
            message["tool_calls"] = [self.tool_calls[i].as_message() for i in sorted(self.tool_calls)]
        return message


class ChatREPL:
    """The read-send-print loop. `messages` holds the conversation without the system prompt."""

    def __init__(
        self,
        transport: Transport,
        *,
        model: str = "default",
        system: str | None = None,
        params: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        input_fn: Callable[[str], str] = input,
        out: TextIO | None = None,
        color: bool | None = None,
    ) -> None:
        self.transport = transport
        self.model = model
        self.system = system
        self.params = dict(params or {})
        self.tools = tools
        self.input_fn = input_fn
        self.out = out if out is not None else sys.stdout
        self.color = self.out.isatty() if color is None else color
        self.messages: list[dict[str, Any]] = []
        self._in_reasoning = False

    # -- the conversation -------------------------------------------------------------------

    def conversation(self) -> list[dict[str, Any]]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + self.messages

    def request_body(self) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "messages": self.conversation(), "stream": True, **self.params}
        if self.tools:
            body["tools"] = self.tools
        return body

    def save(self, path: str) -> None:
        Path(path).write_text(json.dumps({"model": self.model, "messages": self.conversation()}, indent=2) + "\n")

    # -- reading ----------------------------------------------------------------------------

    def read_message(self) -> str:
        """One message: a line, lines joined by a trailing backslash, or a \"\"\" block.
        Raises EOFError (Ctrl-D) and KeyboardInterrupt (Ctrl-C) to the caller."""
        line = self.input_fn(">>> ")
        if line.lstrip().startswith('"""'):
            rest = line.lstrip()[3:]
            if rest.endswith('"""'):
                return rest[:-3]
            lines = [rest] if rest else []
            while True:
                nxt = self.input_fn("... ")
                if nxt.rstrip().endswith('"""'):
                    lines.append(nxt.rstrip()[:-3])
                    return "\n".join(lines).rstrip("\n") if lines else ""
                lines.append(nxt)
        lines = []
        while line.endswith("\\"):
            lines.append(line[:-1])
            line = self.input_fn("... ")
        lines.append(line)
        return "\n".join(lines)

    # -- printing ---------------------------------------------------------------------------

    def _write(self, text: str) -> None:
        self.out.write(text)
        self.out.flush()

    def _reasoning(self, text: str) -> None:
        if not self._in_reasoning:
            self._in_reasoning = True
            self._write(DIM if self.color else "[reasoning] ")
        self._write(text)

    def _end_reasoning(self) -> None:
        if self._in_reasoning:
            self._in_reasoning = False
            self._write((RESET if self.color else "") + "\n")

    def _note(self, text: str) -> None:
        self._write(f"{DIM}{text}{RESET}\n" if self.color else f"{text}\n")

    # -- one turn ---------------------------------------------------------------------------

    def stream_turn(self) -> Turn:
        """Send the conversation, print the answer as it streams, return what it held. Ctrl-C
        (KeyboardInterrupt) and server errors propagate after the stream is closed."""
        turn = Turn()
        events = self.transport(self.request_body())
        try:
            for event in events:
                for choice in event.get("choices") or []:
                    self._apply(turn, choice)
        finally:
            close = getattr(events, "close", None)
            if close is not None:
                close()
            self._end_reasoning()
        return turn

    def _apply(self, turn: Turn, choice: dict[str, Any]) -> None:
        delta = choice.get("delta") or {}
        reasoning = delta.get("reasoning_content") or delta.get("reasoning")
        if reasoning:
            turn.reasoning += reasoning
            self._reasoning(reasoning)
        if delta.get("content"):
            self._end_reasoning()
            turn.content += delta["content"]
            self._write(delta["content"])
        for item in delta.get("tool_calls") or []:
            self._end_reasoning()
            call = turn.tool_calls.setdefault(int(item.get("index", 0)), ToolCall())
            fn = item.get("function") or {}
            call.id = item.get("id") or call.id
            call.name = fn.get("name") or call.name
            call.arguments += fn.get("arguments") or ""
        if choice.get("finish_reason"):
            turn.finish_reason = choice["finish_reason"]

    def turn(self, text: str) -> Turn | None:
        """One user message and its answer. The answer is kept in the conversation only when it
        finished: a cancelled (Ctrl-C) or failed turn leaves the conversation as it was before
        the message (the partial answer is shown, not kept). None for such a turn."""
        self.messages.append({"role": "user", "content": text})
        try:
            turn = self.stream_turn()
        except KeyboardInterrupt:
            self.messages.pop()
            self._write("\n")
            self._note("[cancelled: this turn is not kept]")
            return None
        except FreeTokenError as err:
            self.messages.pop()
            self._write("\n")
            self._note(f"[error: {err}]")
            return None
        if turn.content and not turn.content.endswith("\n"):
            self._write("\n")
        for i in sorted(turn.tool_calls):
            call = turn.tool_calls[i]
            self._note(f"[tool call {call.id}] {call.name}({call.arguments})")
        if turn.finish_reason == "length":
            self._note("[stopped at max_tokens]")
        self.messages.append(turn.as_message())
        return turn

    # -- commands and the loop --------------------------------------------------------------

    def command(self, line: str) -> bool:
        """Run a slash command; False for /exit."""
        name, _, arg = line.strip().partition(" ")
        arg = arg.strip()
        if name in ("/exit", "/quit"):
            return False
        if name == "/reset":
            self.messages.clear()
            self._note("[conversation cleared]")
        elif name == "/system":
            self.system = arg or None
            self._note(f"[system prompt set: {arg}]" if arg else "[system prompt cleared]")
        elif name == "/save":
            if not arg:
                self._note("[usage: /save FILE]")
            else:
                try:
                    self.save(arg)
                    self._note(f"[saved {len(self.conversation())} messages to {arg}]")
                except OSError as err:
                    self._note(f"[cannot save: {err}]")
        elif name == "/help":
            self._write(HELP + "\n")
        else:
            self._note(f"[unknown command {name}; /help lists them]")
        return True

    def run(self) -> None:
        """Until /exit or end of input."""
        while True:
            try:
                text = self.read_message()
            except EOFError:
                self._write("\n")
                return
            except KeyboardInterrupt:
                self._write("\n")  # Ctrl-C at the prompt drops the line being typed
                continue
            if not text.strip():
                continue
            if text.startswith("/") and not text.startswith("//"):
                if not self.command(text):
                    return
                continue
            self.turn(text[1:] if text.startswith("//") else text)


class ChildServer:
    """`ft serve --model M` on a free port of 127.0.0.1, in its own session (the terminal's Ctrl-C
    does not reach it), its output in a temporary log file shown if it fails to start."""

    def __init__(
        self, model: str, serve_args: list[str] | None = None, ready_timeout_s: float = 900.0, log: TextIO | None = None
    ) -> None:
        self.model = model
        self.serve_args = list(serve_args or [])
        self.ready_timeout_s = ready_timeout_s
        self.log = log if log is not None else sys.stderr
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self._log_file: Any = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _log_tail(self) -> str:
        self._log_file.flush()
        with open(self._log_file.name, errors="replace") as f:
            return f.read()[-4000:]

    def __enter__(self) -> ChildServer:
        self.port = free_port()
        cmd = [
            sys.executable,
            "-m",
            "freetoken.cli",
            "serve",
            "--model",
            self.model,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *self.serve_args,
        ]
        self._log_file = tempfile.NamedTemporaryFile(prefix="ft-chat-serve-", suffix=".log", delete=False)  # noqa: SIM115
        self.log.write(f"starting ft serve --model {self.model} on {self.url} (log: {self._log_file.name})\n")
        self.log.flush()
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=self._log_file, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            self._wait_ready()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _wait_ready(self) -> None:
        assert self.proc is not None
        end = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise FreeTokenError(
                    f"ft serve exited with {self.proc.returncode} before it was ready:\n{self._log_tail()}"
                )
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as resp:  # noqa: S310 - our child
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.2)
        raise FreeTokenError(f"ft serve was not ready after {self.ready_timeout_s:.0f} s:\n{self._log_tail()}")

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._log_file is not None:
            self._log_file.close()
            if self.proc is not None and self.proc.returncode in (0, -signal.SIGTERM):
                os.unlink(self._log_file.name)


def greeting(name: str, url: str) -> str:
    """The lines on stderr before the first prompt: what is served where, how to get help and
    out; a note first when the model is a bundled base model (it will ramble, not answer)."""
    note = base_model_note(name)
    head = f"ft chat: note: {note} (`ft serve {CHAT_MODEL}`, or `ft chat --model {CHAT_MODEL}`)\n" if note else ""
    return head + f"ft chat: {name} at {url}; /help for commands, /exit or Ctrl-D to quit\n"


def _input_with_history() -> Callable[[str], str]:
    """`input`, with line editing and history where readline exists and stdin is a terminal;
    without a terminal (piped input) no prompts are printed."""
    if not sys.stdin.isatty():
        return lambda prompt: input()
    try:
        import readline  # noqa: F401 - importing it gives input() editing and history
    except ImportError:
        pass
    return input


def run_chat(
    url: str | None,
    model: str | None,
    api_key: str | None,
    system: str | None,
    max_tokens: int | None,
    temperature: float | None,
    tools_file: str | None,
    serve_args: list[str],
    timeout_s: float,
) -> None:
    """What `ft chat` does with its arguments."""
    tools = None
    if tools_file:
        try:
            tools = json.loads(Path(tools_file).read_text())
        except (OSError, ValueError) as err:
            raise FreeTokenError(f"--tools {tools_file}: {err}") from None
        if not isinstance(tools, list):
            raise FreeTokenError(f"--tools {tools_file}: expected a JSON list of tool definitions")
    params: dict[str, Any] = {}
    if max_tokens is not None:
        params["max_tokens"] = max_tokens
    if temperature is not None:
        params["temperature"] = temperature

    def chat(base_url: str) -> None:
        transport = HTTPTransport(base_url, api_key=api_key, timeout_s=timeout_s)
        names = transport.models()
        name = names[0] if names else "default"
        sys.stderr.write(greeting(name, base_url))
        sys.stderr.flush()
        ChatREPL(transport, model=name, system=system, params=params, tools=tools, input_fn=_input_with_history()).run()

    if model is not None:
        with ChildServer(model, serve_args + (["--api-key", api_key] if api_key else [])) as child:
            chat(child.url)
    else:
        chat(url or DEFAULT_URL)
