"""`ft launch codex|claude|opencode`: point a coding agent at a running `ft serve` and start it.

docs/agents.md's manual steps as a command. It asks the server what it serves (`GET /v1/models`:
the served name and `max_model_len`, else `/health`'s `context_length`), builds a `Plan` per
agent — the files to write (merged into what is there), the environment, the command line — as
plain data, and `run_plan` carries it out: every file it changes is first copied to
`<file>.bak-<YYYYmmdd-HHMMSS>`, what was written is printed, then the agent runs with the
arguments given after `--`. `--dry-run` prints the plan and touches nothing. A missing agent is an
error naming its npm package, after the configuration is written.

Per agent (docs/agents.md):

- codex: `$CODEX_HOME/config.toml` (default `~/.codex/config.toml`). Only FreeToken's own
  `[model_providers.freetoken]` table (Responses wire API) and the top-level `model`,
  `model_provider` and `model_context_window` keys are replaced; `check_for_update_on_startup =
  false` and `[analytics] enabled = false` are added only where the file does not set them. The
  rest of the file is kept byte for byte (comments included): the edit is textual, and the result
  is parsed back and compared with the old file's keys before anything is written — an edit that
  would change any other key is refused with the lines to add by hand.
- claude: environment only, as docs/agents.md sets it (`ANTHROPIC_BASE_URL`, `ANTHROPIC_API_KEY`,
  `ANTHROPIC_MODEL`, `ANTHROPIC_DEFAULT_HAIKU_MODEL`, `CLAUDE_CODE_MAX_OUTPUT_TOKENS` and
  `CLAUDE_CODE_MAX_CONTEXT_TOKENS` from the context, ...) for the child process; no file of
  Claude Code's is written, so a later plain `claude` still talks to Anthropic.
- opencode: `$XDG_CONFIG_HOME/opencode/opencode.json` (default `~/.config/opencode/`): a
  `provider.freetoken` entry (`@ai-sdk/openai-compatible`, `baseURL` `<url>/v1`, the model with
  its context and output limits) and `model` / `small_model`; other keys are kept.

An API key (`--api-key` or `FT_API_KEY`) is sent to the server when reading it and handed to the
agent through its environment (`FREETOKEN_API_KEY`, or `ANTHROPIC_API_KEY`); it is never written to
a file.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from freetoken.errors import ConfigError, FreeTokenError

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the merged file is then not checked before it is written
    tomllib = None  # type: ignore[assignment]

DEFAULT_URL = "http://127.0.0.1:1919"  # ft serve's default --host / --port
KEY_ENV = "FREETOKEN_API_KEY"  # the variable the agents' configs name for the key
PROVIDER = "freetoken"
NO_KEY = "freetoken"  # the Anthropic client insists on a key; a server without --api-key takes any
INSTALL = {
    "codex": "npm install -g @openai/codex (tested with 0.171.0)",
    "claude": "npm install -g @anthropic-ai/claude-code (tested with 2.1.332)",
    "opencode": "npm install -g opencode-ai",
}
# The first prompt of each agent, in Gemma tokens (docs/agents.md): a context below this cannot
# hold even the first turn.
FIRST_PROMPT = {"codex": 6300, "claude": 12000}


@dataclass(frozen=True)
class Served:
    """What the server at `url` serves, as `/v1/models` (and `/health`) said."""

    url: str  # scheme://host:port, no /v1
    model: str  # the name the agent sends
    models: tuple[str, ...]
    context_length: int | None
    api_key: str | None


@dataclass(frozen=True)
class FileWrite:
    path: Path
    old: str | None  # None: the file does not exist
    new: str
    shown: str  # the part of `new` that is FreeToken's, to print


@dataclass(frozen=True)
class Plan:
    agent: str
    binary: str
    args: tuple[str, ...]
    files: tuple[FileWrite, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    unset: tuple[str, ...] = ()  # removed from the inherited environment
    secret: frozenset[str] = frozenset()  # env names whose values are not printed
    notes: tuple[str, ...] = ()


# ---------------------------------------------------------------------------------------------
# The server


def _base_url(url: str) -> str:
    base = url.strip().rstrip("/")
    if base.endswith("/v1"):
        base = base[: -len("/v1")]
    if not re.match(r"^https?://[^/\s]+(/\S*)?$", base):
        raise ConfigError(f"--url must be http(s)://HOST:PORT[/PATH] (the server's address, /v1 optional), got {url!r}")
    return base


class _NotReady(FreeTokenError):
    """`/health` answered 503: the engine is loading or restarting."""


def _get_json(url: str, api_key: str | None, timeout: float) -> Any:
    request = urllib.request.Request(url, headers={"Accept": "application/json"})
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:  # noqa: S310 (http(s) checked above)
            return json.loads(response.read().decode("utf-8"))
    except urllib.error.HTTPError as err:
        if err.code == 503 and url.endswith("/health"):  # ft serve while the engine loads or restarts
            try:
                message = json.loads(err.read().decode("utf-8")).get("message")
            except (ValueError, UnicodeDecodeError, AttributeError, OSError):
                message = None
            raise _NotReady(message or "GET /health answered 503") from None
        if err.code == 401:
            hint = "the key was refused" if api_key else "it needs an API key: pass --api-key KEY or set FT_API_KEY"
            raise FreeTokenError(f"GET {url} answered 401: {hint}") from None
        raise FreeTokenError(
            f"GET {url} answered {err.code}; is this an ft serve (or OpenAI-compatible) server?"
        ) from None
    except (urllib.error.URLError, OSError) as err:
        reason = getattr(err, "reason", err)
        raise FreeTokenError(f"cannot reach {url} ({reason}): start `ft serve` first, or point --url at it") from None
    except (ValueError, UnicodeDecodeError):
        raise FreeTokenError(f"GET {url} did not answer JSON; is this an ft serve server?") from None


def read_server(url: str, api_key: str | None, model: str | None, timeout: float = 10.0) -> Served:
    """The served names and context length; `model` (when given) must be one of them or
    `default`, which the server always accepts."""
    base = _base_url(url)
    body = _get_json(f"{base}/v1/models", api_key, timeout)
    cards = [
        c
        for c in (body.get("data") if isinstance(body, dict) else None) or []
        if isinstance(c, dict) and isinstance(c.get("id"), str)
    ]
    ids = tuple(c["id"] for c in cards)
    if not ids:
        raise FreeTokenError(f"GET {base}/v1/models listed no model")
    if model is not None and model not in ids and model != "default":
        raise ConfigError(f"the server at {base} serves {', '.join(ids)} (or `default`), not {model!r}")
    name = model or ids[0]
    card = next((c for c in cards if c["id"] == name), cards[0])
    context = card.get("max_model_len")
    if not isinstance(context, int) or context <= 0:
        try:
            health = _get_json(f"{base}/health", api_key, timeout)
            context = health.get("context_length") if isinstance(health, dict) else None
        except _NotReady as err:
            raise FreeTokenError(f"the server at {base} is not ready ({err}); rerun when its /health is 200") from None
        except FreeTokenError:  # not an ft serve: no /health
            context = None
    if not isinstance(context, int) or context <= 0:
        context = None
    return Served(url=base, model=name, models=ids, context_length=context, api_key=api_key)


def output_budget(context_length: int | None) -> int:
    """The output tokens an agent asks for per request: an eighth of the context (docs/agents.md's
    4096 at 32768), at least 1024 and at most 32000 (Claude Code's own default)."""
    if context_length is None:
        return 4096
    return min(32000, max(1024, context_length // 8))


def _context_notes(agent: str, served: Served) -> tuple[str, ...]:
    if served.context_length is None:
        return ("the server did not report its context length; limits are left at defaults",)
    need = FIRST_PROMPT.get(agent)
    if need is not None and served.context_length < need + output_budget(served.context_length):
        return (
            f"the served context ({served.context_length} tokens) is small for {agent}: its first prompt alone is about "
            f"{need} tokens (docs/agents.md); serve with a larger --context-length",
        )
    return ()


# ---------------------------------------------------------------------------------------------
# Codex: config.toml


_HEADER = re.compile(r"^\s*\[(\[?)\s*([^\[\]]+?)\s*\]\]?\s*(#.*)?$")
_TOP_KEYS = ("model", "model_provider", "model_context_window")
_TOP_KEY = re.compile(r"^\s*(" + "|".join(_TOP_KEYS) + r")\s*=")


def _toml_str(value: str) -> str:
    return json.dumps(value)  # a JSON string is a TOML basic string (\uXXXX escapes included)


def _table_name(raw: str) -> str:
    return ".".join(part.strip().strip("\"'") for part in raw.split("."))


def _parse_toml(text: str, path: Path) -> dict[str, Any] | None:
    if tomllib is None:
        return None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{path} is not valid TOML ({err}); fix it or move it away, then rerun") from None


def merge_codex_toml(old: str, top: Mapping[str, Any], table: Mapping[str, Any], path: Path) -> tuple[str, str]:
    """`old` with the top-level `_TOP_KEYS` set to `top` and `[model_providers.freetoken]` replaced
    by `table`; `check_for_update_on_startup = false` and `[analytics] enabled = false` where the
    file sets neither. Returns (new text, the lines that are FreeToken's)."""
    before = _parse_toml(old, path) or {}
    top_lines = [f"{k} = {_toml_str(v) if isinstance(v, str) else v}" for k, v in top.items()]
    if "check_for_update_on_startup" not in before:
        top_lines.append("check_for_update_on_startup = false")
    table_lines = [
        f"[model_providers.{PROVIDER}]",
        "# written by `ft launch codex`, which replaces this table when rerun",
    ]
    table_lines += [f"{k} = {_toml_str(v) if isinstance(v, str) else v}" for k, v in table.items()]
    # Each goes where the old one was (so a rerun leaves the file as it is), else at the end of
    # the top-level keys / of the file.
    lines = old.splitlines()
    first = next((i for i, line in enumerate(lines) if _HEADER.match(line)), len(lines))
    head: list[str] = []
    placed = False
    for line in lines[:first]:
        if not _TOP_KEY.match(line):
            head.append(line)
        elif not placed:
            head += top_lines
            placed = True
    while head and not head[-1].strip():
        head.pop()
    if not placed:
        head += top_lines
    rest: list[str] = []
    skipping = placed = False
    for line in lines[first:]:
        m = _HEADER.match(line)
        if m:
            skipping = not m.group(1) and _table_name(m.group(2)) == f"model_providers.{PROVIDER}"
            if skipping and not placed:
                rest += table_lines + [""]
                placed = True
        if not skipping:
            rest.append(line)
    while rest and not rest[-1].strip():
        rest.pop()
    if not placed:
        rest += ([""] if rest else []) + table_lines
    analytics = [] if "analytics" in before else ["[analytics]", "enabled = false"]
    if analytics:
        rest += ["", *analytics]
    new = "\n\n".join("\n".join(part) for part in (head, rest) if part) + "\n"
    if tomllib is not None:
        expected = {k: v for k, v in before.items() if k not in _TOP_KEYS}
        expected.update(top)
        expected.setdefault("check_for_update_on_startup", False)
        expected.setdefault("analytics", {"enabled": False})
        providers = dict(expected.get("model_providers") or {})
        providers[PROVIDER] = dict(table)
        expected["model_providers"] = providers
        try:
            after = tomllib.loads(new)
        except tomllib.TOMLDecodeError:
            after = None
        if after != expected:
            raise ConfigError(
                f"cannot update {path} without touching other keys (a layout this edit does not handle, e.g. "
                f"model_providers.{PROVIDER} as dotted keys); add these lines yourself:\n"
                + "\n".join(top_lines + [""] + table_lines)
            )
    return new, "\n".join(top_lines + [""] + table_lines + ([""] + analytics if analytics else []))


def codex_plan(served: Served, args: Sequence[str], environ: Mapping[str, str]) -> Plan:
    home = Path(environ["CODEX_HOME"]) if environ.get("CODEX_HOME") else _home(environ) / ".codex"
    path = home / "config.toml"
    old = _read(path)
    top: dict[str, Any] = {"model": served.model, "model_provider": PROVIDER}
    if served.context_length is not None:
        top["model_context_window"] = served.context_length
    table: dict[str, Any] = {"name": "FreeToken", "base_url": f"{served.url}/v1", "wire_api": "responses"}
    env: dict[str, str] = {}
    if served.api_key:
        table["env_key"] = KEY_ENV
        env[KEY_ENV] = served.api_key
    table.update(request_max_retries=0, stream_max_retries=0)
    new, shown = merge_codex_toml(old or "", top, table, path)
    return Plan(
        "codex",
        "codex",
        tuple(args),
        (FileWrite(path, old, new, shown),),
        env,
        secret=frozenset({KEY_ENV}),
        notes=_context_notes("codex", served),
    )


# ---------------------------------------------------------------------------------------------
# Claude Code: the environment


def claude_plan(served: Served, args: Sequence[str], environ: Mapping[str, str]) -> Plan:
    env = {
        "ANTHROPIC_BASE_URL": served.url,
        "ANTHROPIC_API_KEY": served.api_key or NO_KEY,
        "ANTHROPIC_MODEL": served.model,
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": served.model,  # its background calls name a model too
        "ANTHROPIC_DEFAULT_SONNET_MODEL": served.model,
        "ANTHROPIC_DEFAULT_OPUS_MODEL": served.model,
        "ANTHROPIC_SMALL_FAST_MODEL": served.model,  # the older name of the HAIKU one
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(output_budget(served.context_length)),
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_AUTOUPDATER": "1",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_ERROR_REPORTING": "1",
        "API_TIMEOUT_MS": "3000000",  # a small model on a CPU takes minutes for the first prompt
    }
    if served.context_length is not None:
        # The window Claude Code 2.1.332 believes for a model name it does not know (else 1M, and it
        # never compacts in time); it also silences its "doesn't recognize the model" notice.
        env["CLAUDE_CODE_MAX_CONTEXT_TOKENS"] = str(served.context_length)
    # A token of the user's own would be sent beside the key (and to this server): not inherited.
    return Plan(
        "claude",
        "claude",
        tuple(args),
        (),
        env,
        unset=("ANTHROPIC_AUTH_TOKEN",),
        secret=frozenset({"ANTHROPIC_API_KEY"}),
        notes=_context_notes("claude", served),
    )


# ---------------------------------------------------------------------------------------------
# OpenCode: opencode.json


def opencode_plan(served: Served, args: Sequence[str], environ: Mapping[str, str]) -> Plan:
    config_home = Path(environ["XDG_CONFIG_HOME"]) if environ.get("XDG_CONFIG_HOME") else _home(environ) / ".config"
    path = config_home / "opencode" / "opencode.json"
    old = _read(path)
    data: dict[str, Any] = {"$schema": "https://opencode.ai/config.json"}
    if old is not None and old.strip():
        try:
            data = json.loads(old)
        except ValueError as err:
            raise ConfigError(
                f"{path} is not plain JSON ({err}; comments?): remove them or move the file away and rerun, "
                "or add the provider yourself (docs/agents.md, OpenCode)"
            ) from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path} is not a JSON object")
    model: dict[str, Any] = {"name": served.model}
    if served.context_length is not None:
        model["limit"] = {"context": served.context_length, "output": output_budget(served.context_length)}
    options: dict[str, Any] = {"baseURL": f"{served.url}/v1"}
    env: dict[str, str] = {}
    if served.api_key:
        options["apiKey"] = "{env:" + KEY_ENV + "}"  # OpenCode substitutes it when it reads the file
        env[KEY_ENV] = served.api_key
    provider = {
        "npm": "@ai-sdk/openai-compatible",
        "name": "FreeToken",
        "options": options,
        "models": {served.model: model},
    }
    providers = data.get("provider")
    if not isinstance(providers, dict):
        providers = {}
    data["provider"] = {**providers, PROVIDER: provider}
    data["model"] = data["small_model"] = f"{PROVIDER}/{served.model}"
    new = json.dumps(data, indent=2) + "\n"
    shown = json.dumps(
        {"provider": {PROVIDER: provider}, "model": data["model"], "small_model": data["small_model"]}, indent=2
    )
    return Plan(
        "opencode",
        "opencode",
        tuple(args),
        (FileWrite(path, old, new, shown),),
        env,
        secret=frozenset({KEY_ENV}),
        notes=_context_notes("opencode", served),
    )


AGENTS: dict[str, Callable[[Served, Sequence[str], Mapping[str, str]], Plan]] = {
    "codex": codex_plan,
    "claude": claude_plan,
    "opencode": opencode_plan,
}


# ---------------------------------------------------------------------------------------------
# Carrying a plan out


def _home(environ: Mapping[str, str]) -> Path:
    return Path(environ["HOME"]) if environ.get("HOME") else Path.home()


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as err:
        raise FreeTokenError(f"cannot read {path}: {err}") from None


def backup_path(path: Path, stamp: str) -> Path:
    candidate = path.with_name(f"{path.name}.bak-{stamp}")
    n = 1
    while candidate.exists():
        candidate = path.with_name(f"{path.name}.bak-{stamp}-{n}")
        n += 1
    return candidate


def write_file(write: FileWrite, stamp: str) -> Path | None:
    """Write `write.new`, first copying an existing file to its backup; returns the backup."""
    backup = None
    write.path.parent.mkdir(parents=True, exist_ok=True)
    if write.path.exists():
        backup = backup_path(write.path, stamp)
        shutil.copy2(write.path, backup)
    tmp = write.path.with_name(f".{write.path.name}.ft-launch-{os.getpid()}")
    tmp.write_text(write.new, encoding="utf-8")
    if backup is not None:
        shutil.copymode(backup, tmp)
    os.replace(tmp, write.path)
    return backup


def describe(plan: Plan, served: Served) -> str:
    lines = [
        f"ft launch {plan.agent}: {served.url} serves {', '.join(served.models)}; using {served.model!r}, "
        f"context {served.context_length if served.context_length is not None else 'unknown'} tokens"
    ]
    for w in plan.files:
        what = "unchanged" if w.old == w.new else ("update" if w.old is not None else "create")
        lines.append(f"{w.path} ({what}; FreeToken's part):")
        lines += ["    " + line for line in w.shown.splitlines()]
    if plan.env or plan.unset:
        lines.append("environment:")
        for k, v in plan.env.items():
            lines.append(f"    {k}={'<key>' if k in plan.secret else shlex.quote(v)}")
        lines += [f"    unset {k}" for k in plan.unset]
    lines.append("command: " + shlex.join([plan.binary, *plan.args]))
    lines += [f"note: {n}" for n in plan.notes]
    return "\n".join(lines)


def run_plan(
    plan: Plan,
    served: Served,
    dry_run: bool = False,
    environ: Mapping[str, str] | None = None,
    out: TextIO | None = None,
) -> int:
    """Print the plan; unless `dry_run`, write its files (with backups) and run the agent, returning
    its exit status. A missing agent raises FreeTokenError after the files are written."""
    environ = os.environ if environ is None else environ
    installed = shutil.which(plan.binary, path=environ.get("PATH")) is not None
    if dry_run:
        missing = (
            ""
            if installed
            else f"\nnote: {plan.binary} is not installed (not on PATH); install it with: {INSTALL[plan.agent]}"
        )
        print(describe(plan, served) + missing + "\n(dry run: nothing written, nothing run)", file=out or sys.stdout)
        return 0
    report = out or sys.stderr  # stdout is the agent's
    print(describe(plan, served), file=report)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for w in plan.files:
        if w.old == w.new:
            continue
        backup = write_file(w, stamp)
        print(f"wrote {w.path}" + (f" (the previous file is {backup})" if backup else ""), file=report)
    binary = shutil.which(plan.binary, path=environ.get("PATH"))
    if binary is None:
        raise FreeTokenError(
            f"{plan.binary} is not installed (not on PATH); install it with: {INSTALL[plan.agent]}, then rerun"
            + (" (the configuration above is written)" if plan.files else "")
        )
    env = {**environ, **plan.env}
    for k in plan.unset:
        env.pop(k, None)
    report.flush()
    try:  # Ctrl-C is the agent's to handle (it gets it too: same process group)
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:  # not the main thread
        previous = None
    try:
        return subprocess.call([binary, *plan.args], env=env)
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)


def _add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=None, help=f"the server (default {DEFAULT_URL}; a trailing /v1 is fine)")
    p.add_argument("--model", default=None, help="the served name the agent sends (default: the first of /v1/models)")
    p.add_argument(
        "--api-key",
        default=None,
        help="the server's --api-key (default: $FT_API_KEY); handed to the agent in its environment, never written to a file",
    )
    p.add_argument(
        "--dry-run", action="store_true", help="print what would be written and run; write nothing, run nothing"
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    """`ft launch`'s arguments. Everything after `launch` is taken as it stands and parsed by
    `command`, so that what follows `--` reaches the agent untouched whatever it looks like."""
    _add_options(p)
    p.add_argument(
        "argv",
        nargs=argparse.REMAINDER,
        metavar="{" + ",".join(AGENTS) + "} [options] [-- ARGS]",
        help="the agent, then the options above, then `--` and the arguments the agent is run with",
    )


def command(args: argparse.Namespace) -> int:
    """`ft launch`: read the server, plan for the agent, carry the plan out; the agent's exit status."""
    argv = list(args.argv)
    if argv[:1] == ["--"]:
        argv = argv[1:]
    head, agent_args = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(
        prog="ft launch",
        description="point a coding agent at a running ft serve and start it (docs/agents.md)",
        usage="ft launch {" + ",".join(AGENTS) + "} [--url URL] [--model NAME] [--api-key KEY] [--dry-run] [-- ARGS]",
        epilog="ARGS after `--` are passed to the agent as they stand.",
    )
    parser.add_argument("agent", choices=list(AGENTS))
    _add_options(parser)
    parser.parse_args(head, namespace=args)  # options given before the agent are kept
    key = args.api_key or os.environ.get("FT_API_KEY") or None
    served = read_server(args.url or DEFAULT_URL, key, args.model)
    plan = AGENTS[args.agent](served, agent_args, os.environ)
    return run_plan(plan, served, args.dry_run)
