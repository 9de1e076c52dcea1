"""Lark grammars (llguidance's dialect) that force one well-formed call in a format.

Owns `call_schema` (the JSON schema of `{"name": <one of the tools>, KEY: <its parameters>}`) and
`forced_call_grammar`, used for `tool_choice: "required"` or a named function: the text a parser
expects around the call, then the call object as `%json`. The server sends it as
`SamplingParams.grammar = ("lark", text)`; the engine enforces it. No parsing and no engine here.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

ANY_OBJECT: dict[str, Any] = {"type": "object"}
COMPACT_JSON: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _function(tool: Mapping[str, Any]) -> Mapping[str, Any]:
    fn = tool.get("function", tool)
    return fn if isinstance(fn, Mapping) else {}


def call_schema(tools: Sequence[Mapping[str, Any]], key: str) -> dict[str, Any]:
    """One call object of any of `tools` (OpenAI tool dicts): its name and its parameters under `key`."""
    options = []
    for tool in tools:
        fn = _function(tool)
        params = fn.get("parameters") or ANY_OBJECT
        options.append(
            {
                "type": "object",
                "properties": {"name": {"const": fn.get("name")}, key: params},
                "required": ["name", key],
                "additionalProperties": False,
            }
        )
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    # Compact JSON with no free whitespace: a weak model cannot spend its tokens on blank space.
    return {**schema, "x-guidance": COMPACT_JSON}


def forced_call_grammar(
    before: str, schema: Mapping[str, Any], after: str, specials: Mapping[str, int] | None = None
) -> str:
    """`before`, a JSON value matching `schema`, then `after` (either may be empty). Text between
    `<|` and `|>` is left bare so llguidance reads it as a special token; `specials` as in `lark_text`."""
    parts = [lark_text(before, specials), "call", lark_text(after, specials)]
    start = " ".join(p for p in parts if p)
    return f"start: {start}\ncall: %json {json.dumps(schema)}\n"


def lark_text(text: str, specials: Mapping[str, int] | None = None) -> str:
    """Lark items for `text`: quoted literals, with `<|...|>` special tokens left bare and the
    texts of `specials` (added tokens of the vocabulary, text -> id) written as their id `<[id]>`:
    llguidance takes added tokens for special ones, which no quoted literal matches."""
    for marker in sorted(specials or {}, key=len, reverse=True):
        if marker in text:
            head, _, tail = text.partition(marker)
            parts = [lark_text(head, specials), f"<[{specials[marker]}]>", lark_text(tail, specials)]  # type: ignore[index]
            return " ".join(p for p in parts if p)
    items: list[str] = []
    rest = text
    while rest:
        i = rest.find("<|")
        j = rest.find("|>", i + 2) if i >= 0 else -1
        if i < 0 or j < 0:
            items.append(json.dumps(rest))
            break
        if i > 0:
            items.append(json.dumps(rest[:i]))
        items.append(rest[i : j + 2])
        rest = rest[j + 2 :]
    return " ".join(items)
