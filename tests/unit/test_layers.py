"""The layers of DESIGN.md §1, held: every import of every module of `freetoken`, read with `ast`.

Layers, bottom to top: `utils`, `ops`, `errors`; `request`, `config`; `kv`, `weights`,
`tokenizer`; `attention`; `models`; `distributed`; `engine`; `llm`, `server`; `cli`. A module
imports only from its own layer or below, and no chain of imports between files comes back to
where it started. Inside `server/` the same holds for its own order: process, plumbing, core, the
routes (the three wire protocols and the admin routes, none importing another), app; and only
`process/` (the engine process's side) imports the engine.

Every import counts — at module level, inside functions, relative ones resolved, `from X import a`
as the submodule `X.a` where there is one — except those under `if TYPE_CHECKING:`, which never
run. (Importing `X.a` also runs package X's `__init__`; that implicit import is not counted, so a
package's `__init__` may re-export its submodules.) A module that no table below places fails the
test: a new module must be given a layer. The checker is run on synthetic sources too (the last
tests), so it cannot pass by seeing nothing.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

import freetoken

PACKAGE = "freetoken"
ROOT = Path(freetoken.__file__).parent

# DESIGN.md §1, bottom to top. An entry names a module or package right under `freetoken` (a
# package's own __init__ is `__init__`); a module's layer is that of the longest entry that is its
# path or a package above it. Entries marked (not in DESIGN) are placed at the lowest layer their
# imports and their role allow (docs/architecture.md, "Layers").
LAYERS: tuple[tuple[str, ...], ...] = (
    ("utils", "ops", "errors"),
    # (not in DESIGN) reasoning_budget: a SamplingParams field, imported by request itself;
    # grammar_text: the llguidance text of a request's grammar (engine and API process both read it).
    ("request", "config", "reasoning_budget", "grammar_text"),
    # (not in DESIGN) families: each model family's torch-free facts (GGUF names and metadata,
    # preflight defaults), read by weights, the server's preflight and models alike.
    ("kv", "weights", "families", "tokenizer"),
    ("attention",),
    ("models",),
    ("distributed",),
    ("engine",),
    # (not in DESIGN) bench: `ft bench` (HTTP scenarios against a server, the in-process decode
    # roofline through `llm`); chat_cli: `ft chat` (an HTTP client of a server, or of an
    # `ft serve` child); launch: `ft launch` (a client of a running server's /v1/models that
    # writes an agent's config; imports only `errors`); __init__: freetoken's own (`__version__`,
    # the lazy `LLM`).
    ("llm", "server", "bench", "chat_cli", "launch", "__init__"),
    ("cli",),
)

# Inside freetoken.server, bottom to top, entries as above but under `freetoken.server`.
# operations/ is what the operator routes do (drain, metrics, resize, the probes' answers);
# admin/ is their router.
SERVER_LAYERS: tuple[tuple[str, ...], ...] = (
    ("process", "__init__"),
    (  # plumbing: what every route is handed or passes through
        "settings", "errors", "context", "preflight", "startup", "console", "middleware", "request_body", "request_hygiene",
        "operations", "sampling_defaults",
    ),
    ("core",),
    ("openai", "responses", "anthropic", "admin"),
    ("app", "serve"),
)
SERVER_LAYER_NAMES = ("process", "plumbing", "core", "routes", "app")
ROUTES = SERVER_LAYER_NAMES.index("routes")  # its units (a protocol package, an admin module) import no other


@dataclass(frozen=True)
class Module:
    name: str  # dotted: freetoken.kv.pool; a package by its own name
    path: str  # for messages: freetoken/kv/pool.py
    source: str
    is_package: bool = False


@dataclass(frozen=True)
class Import:
    importer: Module
    target: str  # a module of the package
    line: int

    def where(self) -> str:
        return f"{self.importer.path}:{self.line}"


def read_package(root: Path = ROOT) -> dict[str, Module]:
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        is_package = parts[-1] == "__init__"
        name = ".".join(parts[:-1] if is_package else parts)
        modules[name] = Module(name, path.relative_to(root.parent).as_posix(), path.read_text(), is_package)
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement under `node`, at any depth, except those in the body of an
    `if TYPE_CHECKING:` (its `else:` runs, so it counts)."""
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        yield node
    elif isinstance(node, ast.If) and _is_type_checking(node.test):
        for child in node.orelse:
            yield from _import_nodes(child)
        return
    for child in ast.iter_child_nodes(node):
        yield from _import_nodes(child)


def _top_level(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """The statements that run at import time: `body`, and the bodies of its if / try / with /
    for blocks, not those of functions or classes."""
    for node in body:
        yield node
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            for field in ("body", "orelse", "finalbody"):
                yield from _top_level([n for n in getattr(node, field, []) if isinstance(n, ast.stmt)])
            for handler in getattr(node, "handlers", []):
                yield from _top_level(handler.body)


def _binds(module: Module, name: str) -> bool:
    """Whether `module` binds `name` at its top level (a module `__getattr__` binds every name)."""
    for node in _top_level(ast.parse(module.source).body):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name in (name, "__getattr__"):
            return True
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            if any((alias.asname or alias.name.split(".")[0]) == name for alias in node.names):
                return True
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(n, ast.Name) and n.id == name for t in targets for n in ast.walk(t)):
                return True
    return False


def imports_of(module: Module, modules: Mapping[str, Module]) -> list[Import]:
    """The modules of the package that `module` imports (not under TYPE_CHECKING), by line.
    `from X import a` is the submodule `X.a` where that is a module of the package, else `X`
    itself (for a package X, only where its __init__ binds `a`: an `a` it does not bind is a
    compiled extension such as freetoken.ops._qlinear_cpu, which imports nothing of ours); anything
    outside the package is left out."""
    package = module.name if module.is_package else module.name.rpartition(".")[0]
    found: list[Import] = []
    for node in _import_nodes(ast.parse(module.source)):
        if isinstance(node, ast.Import):
            found.extend(Import(module, alias.name, node.lineno) for alias in node.names)
            continue
        if node.level:
            base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
            target = ".".join([*base, node.module] if node.module else base)
        else:
            target = node.module or ""
        for alias in node.names:
            sub = f"{target}.{alias.name}"
            if sub in modules:
                found.append(Import(module, sub, node.lineno))
            elif target in modules and (
                not modules[target].is_package or alias.name == "*" or _binds(modules[target], alias.name)
            ):
                found.append(Import(module, target, node.lineno))
    return list(dict.fromkeys(i for i in found if i.target in modules and i.target != module.name))


def _table_path(module: Module, prefix: str) -> str | None:
    """`module`'s dotted path below the package `prefix`, a package's own file as `__init__`
    (`freetoken.server.core` -> `core.__init__`); None when it is not below `prefix`."""
    name = f"{module.name}.__init__" if module.is_package else module.name
    return name[len(prefix) + 1 :] if name.startswith(prefix + ".") else None


def _place(path: str, table: tuple[tuple[str, ...], ...]) -> tuple[int, str] | None:
    """(layer index, entry) of a table path: the longest entry that is `path` or a package above it."""
    best: tuple[int, str] | None = None
    for index, entries in enumerate(table):
        for entry in entries:
            if (path == entry or path.startswith(entry + ".")) and (best is None or len(entry) > len(best[1])):
                best = (index, entry)
    return best


def layer(module: Module) -> tuple[int, str]:
    """(index, label) of a module's layer in LAYERS, the label naming its entry and the layer's
    number from the bottom (`kv (layer 3)`); KeyError when no entry places it."""
    path = _table_path(module, PACKAGE)
    place = None if path is None else _place(path, LAYERS)
    if place is None:
        raise KeyError(module.name)
    entry = "freetoken/__init__.py" if place[1] == "__init__" else place[1]
    return place[0], f"{entry} (layer {place[0] + 1})"


def server_layer(module: Module) -> tuple[int, str, str] | None:
    """(index, level name, entry) inside the server for a module of it, else None; KeyError when
    SERVER_LAYERS does not place it. The entry is the route unit (`openai`, ...) on the routes."""
    path = _table_path(module, f"{PACKAGE}.server")
    if path is None:
        return None
    place = _place(path, SERVER_LAYERS)
    if place is None:
        raise KeyError(module.name)
    return place[0], SERVER_LAYER_NAMES[place[0]], place[1]


def unplaced(modules: Mapping[str, Module]) -> list[str]:
    bad = []
    for name, module in modules.items():
        try:
            layer(module)
            server_layer(module)
        except KeyError:
            bad.append(f"{module.path}: no layer places {name} (add it to LAYERS or SERVER_LAYERS)")
    return bad


def upward_imports(modules: Mapping[str, Module]) -> list[str]:
    """Every import that runs up a layer — or across the server's routes, or to the routes from
    anywhere but app.py, or from the server outside process/ into the engine — as a message naming
    the file and line, the imported module and both layers."""
    engine = next(index for index, entries in enumerate(LAYERS) if "engine" in entries)
    bad = []
    for module in modules.values():
        for imp in imports_of(module, modules):
            target = modules[imp.target]
            (low, low_label), (high, high_label) = layer(module), layer(target)
            if high > low:
                bad.append(f"{imp.where()} imports {imp.target}: {low_label} imports {high_label}, above it")
                continue
            own, other = server_layer(module), server_layer(target)
            if own is not None and other is not None:
                if other[0] > own[0]:
                    bad.append(
                        f"{imp.where()} imports {imp.target}: server layer {own[1]} imports server layer {other[1]}, above it"
                    )
                elif own[0] == other[0] == ROUTES and own[2] != other[2]:
                    bad.append(
                        f"{imp.where()} imports {imp.target}: server routes {own[2]} import server routes {other[2]}"
                        " (no protocol or admin route imports another)"
                    )
                elif other[0] == ROUTES and own[0] > ROUTES and own[2] != "app":
                    bad.append(
                        f"{imp.where()} imports {imp.target}: server layer {own[1]} ({own[2]}) imports server routes"
                        f" {other[2]} (only app.py includes the routes)"
                    )
            elif own is not None and own[1] != "process" and high == engine:
                bad.append(
                    f"{imp.where()} imports {imp.target}: server layer {own[1]} imports layer engine"
                    " (the server reaches the engine only through process/)"
                )
    return bad


def cycles(modules: Mapping[str, Module]) -> list[str]:
    """Each import cycle between files (a strongly connected component of more than one module),
    with the imports that close it."""
    graph: dict[str, list[Import]] = {name: imports_of(module, modules) for name, module in modules.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan; the package is small enough for recursion
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for imp in graph[v]:
            w = imp.target
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for name in graph:
        if name not in index:
            visit(name)
    out = []
    for component in found:
        edges = [f"{i.where()} imports {i.target}" for m in component for i in graph[m] if i.target in component]
        layers = sorted({layer(modules[m])[1] for m in component})
        out.append(f"import cycle between {', '.join(component)} ({', '.join(layers)}): " + "; ".join(edges))
    return out


# --- the package itself ---------------------------------------------------------------------

MODULES = read_package()


def test_every_module_has_a_layer() -> None:
    assert unplaced(MODULES) == []


def test_no_import_runs_up_a_layer() -> None:
    assert upward_imports(MODULES) == []


def test_no_import_cycle() -> None:
    assert cycles(MODULES) == []


def test_the_tables_name_real_modules() -> None:
    """Every entry of the tables names something that exists, so no rule is about a name that
    went away; and the checker sees the package (hundreds of imports, the app's protocols)."""
    for prefix, table in ((PACKAGE, LAYERS), (f"{PACKAGE}.server", SERVER_LAYERS)):
        paths = {p for m in MODULES.values() if (p := _table_path(m, prefix)) is not None}
        for entry in (e for entries in table for e in entries):
            assert any(p == entry or p.startswith(entry + ".") for p in paths), f"{prefix}: {entry}"
    assert sum(len(imports_of(m, MODULES)) for m in MODULES.values()) > 300
    app = {i.target for i in imports_of(MODULES[f"{PACKAGE}.server.app"], MODULES)}
    for protocol in ("openai", "responses", "anthropic"):
        assert any(t.startswith(f"{PACKAGE}.server.{protocol}.") for t in app), protocol


# --- the checker on synthetic sources (negative controls) ------------------------------------


def synthetic(**sources: str) -> dict[str, Module]:
    """Modules from `dotted__name=source` (`__` for `.`; a trailing `__init` makes a package)."""
    out = {}
    for key, source in sources.items():
        parts = key.split("__")
        is_package = parts[-1] == "init"
        name = ".".join(parts[:-1] if is_package else parts)
        path = "/".join(parts) + ".py"
        out[name] = Module(name, path, source, is_package)
    return out


def test_an_upward_import_is_found_and_named() -> None:
    modules = synthetic(
        freetoken__kv__pool="from freetoken.models.config import ModelConfig\n",
        freetoken__models__config="",
    )
    assert upward_imports(modules) == [
        "freetoken/kv/pool.py:1 imports freetoken.models.config: kv (layer 3) imports models (layer 5), above it"
    ]


def test_a_cycle_is_found_and_named() -> None:
    modules = synthetic(
        freetoken__models__init="",
        freetoken__models__config="def from_hf():\n    from freetoken.models import families\n",
        freetoken__models__families="from .config import ModelConfig\n",
    )
    assert upward_imports(modules) == []  # one layer: only the cycle is wrong
    assert cycles(modules) == [
        "import cycle between freetoken.models.config, freetoken.models.families (models (layer 5)): "
        "freetoken/models/config.py:2 imports freetoken.models.families; "
        "freetoken/models/families.py:1 imports freetoken.models.config"
    ]


def test_a_module_without_a_layer_is_found() -> None:
    modules = synthetic(
        freetoken__scratch="", freetoken__server__extra="", freetoken__server__core__extra="",
    )
    assert unplaced(modules) == [
        "freetoken/scratch.py: no layer places freetoken.scratch (add it to LAYERS or SERVER_LAYERS)",
        "freetoken/server/extra.py: no layer places freetoken.server.extra (add it to LAYERS or SERVER_LAYERS)",
    ]  # a new module of core/ is core's


@pytest.mark.parametrize(
    ("module", "source", "broken"),
    [
        ("freetoken.distributed.follower", "from freetoken.engine.runner import run_model", True),
        ("freetoken.distributed.launch", "from ..server.process import exit_codes", True),
        ("freetoken.models.llama", "import freetoken.engine.scheduler", True),
        ("freetoken.kv.tree", "def f():\n    from freetoken.models import config", True),
        ("freetoken.kv.tree", "if TYPE_CHECKING:\n    from freetoken.models.config import ModelConfig", False),
        ("freetoken.kv.tree", "if TYPE_CHECKING:\n    pass\nelse:\n    from freetoken.models import config", True),
        ("freetoken.server.context", "from freetoken.server.core.errors import APIError", True),
        ("freetoken.server.process.client", "from freetoken.server.errors import APIError", True),
        ("freetoken.server.core.generation", "def f():\n    from freetoken.server.app import build_app", True),
        ("freetoken.server.anthropic.messages", "from ..openai import chat", True),
        ("freetoken.server.responses.routes", "from freetoken.server.anthropic import messages", True),
        ("freetoken.server.operations.worker_info", "from freetoken.server.openai import chat", True),
        ("freetoken.server.admin.routes", "from freetoken.server.openai import chat", True),
        ("freetoken.server.context", "from freetoken.engine import engine", True),
        ("freetoken.server.process.worker", "from freetoken.engine import engine", False),
        ("freetoken.server.anthropic.messages", "from freetoken.server.core.chat_prompt import render_chat", False),
        ("freetoken.server.anthropic.messages", "from .protocol import MessagesRequest", False),
        ("freetoken.server.context", "from freetoken.server.errors import APIError", False),
        ("freetoken.server.app", "from freetoken.server.openai.chat import create_chat_completion", False),
        ("freetoken.server.serve", "from freetoken.server.openai import chat", True),
        ("freetoken.server.serve", "from freetoken.server.app import build_app", False),
        ("freetoken.engine.runner", "from freetoken.distributed.launch import Peers", False),
        ("freetoken.cli", "from freetoken import __version__", False),
        ("freetoken.errors", "from freetoken import __version__", True),
    ],
)
def test_each_rule_is_checked(module: str, source: str, broken: bool) -> None:
    """`module` importing with `source`, among stand-ins for every module it could name."""
    targets = {
        "freetoken.engine", "freetoken.engine.runner", "freetoken.engine.scheduler", "freetoken.engine.engine",
        "freetoken.server.process", "freetoken.server.process.exit_codes", "freetoken.server.errors",
        "freetoken.server.core.errors", "freetoken.server.core.chat_prompt", "freetoken.server.app",
        "freetoken.server.openai", "freetoken.server.openai.chat", "freetoken.server.anthropic",
        "freetoken.server.anthropic.messages", "freetoken.server.anthropic.protocol", "freetoken.models",
        "freetoken.models.config", "freetoken.distributed.launch", "freetoken",
    }
    packages = {"freetoken", "freetoken.engine", "freetoken.server.process", "freetoken.server.openai",
                "freetoken.server.anthropic", "freetoken.models"}
    modules = {t: Module(t, t.replace(".", "/") + ".py", "__version__ = '0'\n", t in packages) for t in targets}
    modules[module] = Module(module, module.replace(".", "/") + ".py", source)
    assert bool(upward_imports(modules)) == broken, upward_imports(modules)
