"""Refusing, in the API process, a grammar the engine could not enforce.

Owns `check_grammar`: the request's grammar (`(kind, text)`, as `SamplingParams.grammar`) is
compiled with llguidance against a 257-token byte tokenizer (built per call, in microseconds; no
model vocabulary needed) and must yield a matcher with a first step, and a JSON schema must admit
at least one finite value (`unsatisfiable_ref`: a `$ref` cycle such as `a -> b -> a`, or a required
property whose schema is such a cycle, compiles but leaves the engine's matcher no token at some
point, which used to end the request as an engine error). Either failure is a 400 naming the
request field. It imports no torch and never touches the engine; the engine still compiles the
grammar again for its own tokenizer (engine/grammar.py).
"""

from __future__ import annotations

import json
from typing import Any

import llguidance

from freetoken.grammar_text import grammar_text
from freetoken.server.errors import bad_request

_EOS = 256


class _ByteTokenizer:
    """One token per byte and an EOS: what llguidance needs to run a grammar's first step."""

    eos_token_id = _EOS
    bos_token_id = None
    tokens = [bytes([b]) for b in range(256)] + [b"<eos>"]
    special_token_ids = [_EOS]

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


def grammar_problem(kind: str, text: str) -> str | None:
    """Why the grammar cannot be enforced, in one line; None when it can."""
    try:
        definition = grammar_text(kind, text)
    except (ValueError, RecursionError) as err:
        return f"the {kind} grammar is not valid: {err}"
    except KeyError:
        return f"unknown grammar kind {kind!r}"
    if kind == "json_schema":
        try:
            schema = json.loads(text)
        except (ValueError, RecursionError) as err:
            return f"the schema is not valid JSON: {err}"
        where = unsatisfiable_ref(schema)
        if where is not None:
            return f"the schema admits no finite JSON value: the $ref at {where} never ends (a $ref cycle)"
    tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteTokenizer()))
    error = llguidance.LLMatcher.validate_grammar(definition, tokenizer)
    if error:
        return f"the {kind} grammar does not compile: {error.strip().splitlines()[0]}"
    matcher = llguidance.LLMatcher(tokenizer, definition, log_level=0)
    matcher.compute_logit_bias()  # the first step: a grammar with no way to start fails here
    if matcher.is_error():
        return f"the {kind} grammar allows no output ({matcher.get_error().strip().splitlines()[0]})"
    return None


def check_grammar(grammar: tuple[str, str] | None, param: str) -> None:
    """A 400 naming `param` when `grammar` cannot be enforced."""
    if grammar is None:
        return
    problem = grammar_problem(*grammar)
    if problem is not None:
        raise bad_request(f"{param}: {problem}", param=param, code="invalid_grammar")


def check_tool_schemas(schemas: list[tuple[str, Any]]) -> None:
    """A 400 naming the tool when a forced call's parameters schema admits no finite value. (The
    forced-call grammar itself names the vocabulary's special tokens, which a byte tokenizer lacks,
    so it is not compiled here; its JSON schemas are checked on their own.)"""
    for param, schema in schemas:
        where = unsatisfiable_ref(schema)
        if where is not None:
            raise bad_request(
                f"{param}: the schema admits no finite JSON value: the $ref at {where} never ends (a $ref cycle)",
                param=param,
                code="invalid_grammar",
            )


def _resolve(root: Any, ref: str) -> Any:
    """The node a local `$ref` (`#`, `#/a/b`) points at, or None (remote or dangling: the compiler's to judge)."""
    if ref == "#":
        return root
    if not ref.startswith("#/"):
        return None
    node = root
    for raw in ref[2:].split("/"):
        part = raw.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")
_SINGLES = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames")


def _children(node: dict[str, Any], where: str) -> list[tuple[Any, str]]:
    out: list[tuple[Any, str]] = []
    for key in _SINGLES:
        if isinstance(node.get(key), (dict, list)):
            value = node[key]
            if isinstance(value, list):
                out.extend((v, f"{where}/{key}/{i}") for i, v in enumerate(value))
            else:
                out.append((value, f"{where}/{key}"))
    for key in _LISTS:
        if isinstance(node.get(key), list):
            out.extend((v, f"{where}/{key}/{i}") for i, v in enumerate(node[key]))
    for key in _MAPS:
        if isinstance(node.get(key), dict):
            out.extend((v, f"{where}/{key}/{k}") for k, v in node[key].items())
    return out


def unsatisfiable_ref(schema: Any) -> str | None:
    """The JSON pointer of a `$ref` that can never end, when the root schema therefore admits no
    finite value; None otherwise. A least fixpoint over the schema's nodes (linear in their number): a node is productive
    when its `$ref` target, its `allOf` members, one `anyOf`/`oneOf` branch, its required
    properties and (with `minItems` > 0) its items are. Constraints other than these structural
    ones are the compiler's; a node this does not understand counts as productive."""
    if not isinstance(schema, dict):
        return None
    nodes = _schema_nodes(schema)
    if not any("$ref" in n for n, _ in nodes.values()):
        return None
    known = _productive(nodes, {key: _needs(schema, node) for key, (node, _) in nodes.items()})
    if id(schema) in known:
        return None
    refs = [where for key, (node, where) in nodes.items() if key not in known and "$ref" in node]
    return min(refs, key=lambda w: (len(w), w)) if refs else "#"


def _schema_nodes(schema: dict[str, Any]) -> dict[int, tuple[dict[str, Any], str]]:
    """Every dict node reachable through the schema keywords, by identity, with its JSON pointer."""
    nodes: dict[int, tuple[dict[str, Any], str]] = {}
    stack: list[tuple[Any, str]] = [(schema, "#")]
    while stack:
        node, where = stack.pop()
        if not isinstance(node, dict) or id(node) in nodes:
            continue
        nodes[id(node)] = (node, where)
        stack.extend(_children(node, where))
    return nodes


def _needs(schema: dict[str, Any], node: dict[str, Any]) -> tuple[list[Any], list[list[Any]]]:
    """What makes `node` productive: (every one of these, and one of each of these groups)."""
    every: list[Any] = []
    groups: list[list[Any]] = []
    if isinstance(node.get("$ref"), str):
        target = _resolve(schema, node["$ref"])
        if target is not None:
            every.append(target)
    if isinstance(node.get("allOf"), list):
        every.extend(node["allOf"])
    for key in ("anyOf", "oneOf"):
        if isinstance(node.get(key), list) and node[key]:
            groups.append(list(node[key]))
    props = node.get("properties") if isinstance(node.get("properties"), dict) else {}
    required = node.get("required") if isinstance(node.get("required"), list) else []
    for name in required:
        if isinstance(name, str) and name in props:
            every.append(props[name])
    min_items = node.get("minItems")
    if isinstance(min_items, int) and min_items > 0:
        prefix = node.get("prefixItems") if isinstance(node.get("prefixItems"), list) else []
        every.extend(prefix[:min_items])
        if len(prefix) < min_items and isinstance(node.get("items"), dict):
            every.append(node["items"])
    return every, groups


def _productive(
    nodes: dict[int, tuple[dict[str, Any], str]], needs: dict[int, tuple[list[Any], list[list[Any]]]]
) -> set[int]:
    """The ids of the productive nodes. Horn-clause propagation (linear): each node waits for its
    `every` dependencies and for one member of each group; a dependency that is not a dict node
    is settled at once."""
    waiting_every: dict[int, int] = {}
    waiting_groups: dict[int, int] = {}
    parents: dict[int, list[tuple[int, int]]] = {}  # dependency -> (node, group index or -1)
    ready: list[int] = []
    for key in nodes:
        every, groups = needs[key]
        blocked = False
        count = 0
        for dep in every:
            if dep is False:
                blocked = True
            elif isinstance(dep, dict) and id(dep) in nodes:
                parents.setdefault(id(dep), []).append((key, -1))
                count += 1
        open_groups = 0
        for g, members in enumerate(groups):
            if any(
                not isinstance(m, dict) and m is not False or (isinstance(m, dict) and id(m) not in nodes)
                for m in members
            ):
                continue  # a member that is settled productive already
            open_groups += 1
            for m in members:
                if isinstance(m, dict):
                    parents.setdefault(id(m), []).append((key, g))
        if blocked:
            continue
        waiting_every[key], waiting_groups[key] = count, open_groups
        if count == 0 and open_groups == 0:
            ready.append(key)
    known: set[int] = set()
    done_groups: set[tuple[int, int]] = set()
    while ready:
        key = ready.pop()
        if key in known:
            continue
        known.add(key)
        for parent, g in parents.get(key, ()):
            if parent not in waiting_every:
                continue  # blocked for good by a `false` dependency
            if g < 0:
                waiting_every[parent] -= 1
            elif (parent, g) not in done_groups:
                done_groups.add((parent, g))
                waiting_groups[parent] -= 1
            else:
                continue
            if waiting_every[parent] == 0 and waiting_groups[parent] == 0:
                ready.append(parent)
    return known
