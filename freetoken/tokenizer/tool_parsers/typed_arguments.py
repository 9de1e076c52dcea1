"""Call arguments written as key / raw-text value pairs (Qwen3-Coder's `<parameter=K>`, GLM's
`<arg_key>`/`<arg_value>`), turned into the JSON text of an arguments object while they stream.

Owns `ArgumentWriter` (one call's arguments: each value typed by the tool's JSON schema — a value
the schema says is a string is the raw text and streams as it is written; any other value is held
until it ends, then read as JSON, a string when it is none or not of the schema's type), `value_types`
(the JSON types a property schema allows) and `raw_value` (a JSON value as such a format writes it:
strings raw, anything else as JSON; `raw_pairs`, a call's arguments so), and the Lark pieces the two
formats' forced-call grammars share (`text_until`, `text_without`, `value_rule`, and `pairs_grammar`,
the grammar's assembly around the format's items). It knows no markers of either format.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from freetoken.tokenizer.tool_parsers.grammar import COMPACT_JSON

Schema = Mapping[str, Any]
_PY_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "object": (dict,),
    "array": (list,),
    "null": (type(None),),
}


def value_types(schema: Schema | None) -> frozenset[str]:
    """The JSON types `schema` allows (`type`, else the types of its `enum` / `const` values);
    a property with no schema, or none of these, is a string."""
    if not isinstance(schema, Mapping):
        return frozenset({"string"})
    declared = schema.get("type")
    if isinstance(declared, str):
        return frozenset({declared})
    if isinstance(declared, list) and declared:
        return frozenset(t for t in declared if isinstance(t, str))
    values = list(schema.get("enum") or ()) + ([schema["const"]] if "const" in schema else [])
    types = {name for v in values for name, py in _PY_TYPES.items() if _is(v, py, name)}
    for key in ("anyOf", "oneOf"):
        for option in schema.get(key) or ():
            types |= value_types(option) if isinstance(option, Mapping) and option else set()
    return frozenset(types or {"string"})


def _is(value: object, types: tuple[type, ...], name: str) -> bool:
    if isinstance(value, bool) and name in ("integer", "number"):
        return False
    return isinstance(value, types)


def typed_value(raw: str, types: frozenset[str]) -> object:
    """`raw` as the value the schema's `types` want: JSON of one of them, else the text itself."""
    if types == {"string"}:
        return raw
    text = raw.strip()
    try:
        value = json.loads(text)
    except ValueError:
        lowered = {"true": True, "false": False, "none": None, "null": None}.get(text.lower(), raw)
        value = lowered
    if any(_is(value, _PY_TYPES[t], t) for t in types if t in _PY_TYPES):
        return value
    return raw


def raw_value(value: object) -> str:
    """A JSON value as these formats write it (their chat templates do the same): a string as
    itself, anything else as JSON."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def raw_pairs(arguments: str) -> list[tuple[str, str]]:
    """A call's JSON arguments as (key, raw value) pairs, as these formats write them; none when
    the text is not JSON of an object."""
    try:
        args = json.loads(arguments)
    except ValueError:
        args = {}
    return [(k, raw_value(v)) for k, v in (args if isinstance(args, dict) else {}).items()]


class ArgumentWriter:
    """One call's arguments object as JSON text, written pair by pair: `key`, then `value` pieces
    of its raw text, then `end_value`; `close` ends the object (and a value still open). Each
    method returns the JSON text it makes certain."""

    def __init__(self, properties: Mapping[str, Schema] | None) -> None:
        self._properties = properties or {}
        self._count = 0
        self._types: frozenset[str] | None = None  # of the open value; None between values
        self._held = ""  # the open value's raw text, when it is not a streamed string

    @property
    def in_value(self) -> bool:
        return self._types is not None

    def key(self, name: str) -> str:
        self._types = value_types(self._properties.get(name))
        self._held = ""
        head = ("{" if self._count == 0 else ", ") + json.dumps(name, ensure_ascii=False) + ": "
        self._count += 1
        return head + ('"' if self._streams else "")

    @property
    def _streams(self) -> bool:
        return self._types == {"string"}

    def value(self, text: str) -> str:
        if self._streams:
            return json.dumps(text, ensure_ascii=False)[1:-1]
        self._held += text
        return ""

    def end_value(self) -> str:
        assert self._types is not None
        out = '"' if self._streams else json.dumps(typed_value(self._held, self._types), ensure_ascii=False)
        self._types, self._held = None, ""
        return out

    def close(self) -> str:
        out = self.end_value() if self.in_value else ""
        return out + ("}" if self._count else "{}")


def text_until(end: str, forbidden: tuple[str, ...]) -> str:
    """A Lark terminal body (llguidance's regex `&` / `~`): any text that ends with `end` and holds
    none of `forbidden` before it. One lexeme, so the end marker cannot be mistaken for text."""
    esc = [_regex(s) for s in forbidden]
    return f"/(?s:.*){_regex(end)}/ & ~/(?s:.*)({'|'.join(esc)})(?s:.+)/"


def text_without(forbidden: tuple[str, ...]) -> str:
    """A Lark terminal body: any text (maybe empty) holding none of `forbidden`."""
    return f"/(?s:.*)/ & ~/(?s:.*)({'|'.join(_regex(s) for s in forbidden)})(?s:.*)/"


def _regex(text: str) -> str:
    return "".join("\\" + ch if ch in ".^$*+?()[]{}|\\/" else ("\\n" if ch == "\n" else ch) for ch in text)


def value_rule(schema: Schema | None, string_terminal: str) -> tuple[str, bool]:
    """A Lark rule body for one value: a string enum as its literals, any other string as
    `string_terminal` (which holds the value's end marker: True in the answer), anything else as
    `%json` (the caller writes the end marker after it)."""
    types = value_types(schema)
    enum = list(schema.get("enum") or ()) if isinstance(schema, Mapping) else []
    if isinstance(schema, Mapping) and "const" in schema:
        enum = [schema["const"]]
    if enum and all(isinstance(v, str) for v in enum):
        return " | ".join(json.dumps(v) for v in enum), False
    if types == {"string"}:
        return string_terminal, True
    return f"%json {json.dumps({**(schema or {}), 'x-guidance': COMPACT_JSON})}", False


def pairs_grammar(
    tools: Sequence[Mapping[str, Any]],
    *,
    start: str,
    name: Callable[[str], str],
    pair: Callable[[str, str, bool], str],
    string_value: str,
) -> str:
    """A Lark grammar of one call of one of `tools` written as key / raw-value pairs: `start`
    (the rule body around the item `call`), then per tool `name(tool name)` (its items) and its
    declared parameters in schema order, the required ones always, the others optional. A
    parameter is `pair(key, value, is_string)`: its items around `value`, the rule of its value
    (`value_rule`; `is_string`: the value is `STRING_VALUE`, whose terminal body is
    `string_value`)."""
    rules, options = [], []
    for k, tool in enumerate(tools):
        fn = tool.get("function", tool)
        schema = fn.get("parameters") or {}
        required = set(schema.get("required") or ())
        items = []
        for j, (key, prop) in enumerate((schema.get("properties") or {}).items()):
            body, is_string = value_rule(prop, "STRING_VALUE")
            rules.append(f"v{k}_{j}: {body}")
            rules.append(f"p{k}_{j}: {pair(key, f'v{k}_{j}', is_string)}")
            items.append(f"p{k}_{j}" if key in required else f"p{k}_{j}?")
        options.append(" ".join([name(str(fn.get("name"))), *items]))
    return (
        f"start: {start}\ncall: {' | '.join(options)}\n"
        + "".join(r + "\n" for r in rules)
        + f"STRING_VALUE: {string_value}\n"
    )
