"""The server package's layers (freetoken/server/__init__.py): who may import whom.

Read from the source with `ast`, every import counted (inside functions and `TYPE_CHECKING`
blocks too, relative ones resolved): no wire-protocol package imports another, the generation
core imports no protocol package (nor the app), `process/` imports only itself, and outside the
protocol packages only `app.py` imports one.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import freetoken.server

SERVER = Path(freetoken.server.__file__).parent
PACKAGE = "freetoken.server"
PROTOCOLS = ("openai", "responses", "anthropic")


def module_name(path: Path) -> str:
    parts = path.relative_to(SERVER).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join((PACKAGE, *parts))


def imported_modules(source: str, module: str, is_package: bool = False) -> set[str]:
    """Every module `source` (the text of `module`) imports, as absolute dotted names; for
    `from X import a`, both `X` and `X.a` (a may be a submodule)."""
    out: set[str] = set()
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            out.add(target)
            out.update(f"{target}.{alias.name}" for alias in node.names)
    return out


def server_part(name: str) -> str | None:
    """The first component under freetoken.server (`core`, `openai`, `app`, ...), or None."""
    if not name.startswith(PACKAGE + "."):
        return None
    return name[len(PACKAGE) + 1 :].split(".")[0]


def imports_by_module() -> dict[str, set[str]]:
    found = {}
    for path in sorted(SERVER.rglob("*.py")):
        name = module_name(path)
        found[name] = {p for m in imported_modules(path.read_text(), name, path.name == "__init__.py") if (p := server_part(m))}
    return found


def violations(imports: dict[str, set[str]]) -> list[str]:
    """Each broken rule as `module -> part`."""
    bad = []
    for module, parts in imports.items():
        own = server_part(module)
        for part in sorted(parts - {own}):
            if own in PROTOCOLS and part in PROTOCOLS:
                bad.append(f"{module} -> {part} (a protocol package imports another)")
            elif own == "core" and (part in PROTOCOLS or part in ("app", "serve")):
                bad.append(f"{module} -> {part} (the core imports a protocol package or the app)")
            elif own == "process":
                bad.append(f"{module} -> {part} (process/ imports only itself)")
            elif own not in PROTOCOLS and own != "app" and part in PROTOCOLS:
                bad.append(f"{module} -> {part} (only app.py imports protocol packages)")
    return bad


def test_the_layers_hold() -> None:
    imports = imports_by_module()
    for protocol in PROTOCOLS:  # the rules are about real packages, not names that went away
        assert sum(1 for m in imports if server_part(m) == protocol) >= 3, protocol
    assert any(server_part(m) == "core" for m in imports)
    assert {"core", *PROTOCOLS} <= imports[f"{PACKAGE}.app"]
    assert violations(imports) == []


@pytest.mark.parametrize(
    ("module", "source", "broken"),
    [
        ("freetoken.server.anthropic.messages", "from freetoken.server.openai.chat import render_chat", True),
        ("freetoken.server.anthropic.messages", "from ..openai import chat", True),
        ("freetoken.server.responses.routes", "from freetoken.server import anthropic", True),
        ("freetoken.server.core.generation", "if TYPE_CHECKING:\n    import freetoken.server.responses.store", True),
        ("freetoken.server.core.generation", "def f():\n    from freetoken.server.app import build_app", True),
        ("freetoken.server.process.client", "from freetoken.server.core.errors import APIError", True),
        ("freetoken.server.context", "from freetoken.server.openai.protocol import ChatMessage", True),
        ("freetoken.server.anthropic.messages", "from freetoken.server.core.chat_prompt import render_chat", False),
        ("freetoken.server.anthropic.messages", "from .protocol import MessagesRequest", False),
        ("freetoken.server.app", "from freetoken.server.openai.chat import create_chat_completion", False),
        ("freetoken.server.openai.chat", "from freetoken.server.openai.pins import openai_pins", False),
    ],
)
def test_a_broken_rule_is_found(module: str, source: str, broken: bool) -> None:
    parts = {p for m in imported_modules(source, module) if (p := server_part(m))}
    assert bool(violations({module: parts})) == broken
