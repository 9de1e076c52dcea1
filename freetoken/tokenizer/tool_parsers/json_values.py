"""Reading the JSON that call blocks hold: one value, a list, or several values in a row.

Owns `json_values` (every JSON value of a text, optionally separated by `;`, or None when anything
else is there) and `calls_from_values`. No format markers and no streaming here.
"""

from __future__ import annotations

import json

from freetoken.tokenizer.tool_parsers.base import ToolCall, call_from_object

_DECODER = json.JSONDecoder()


def json_values(text: str, *, separators: str = "") -> list[object] | None:
    """The JSON values `text` is made of (whitespace and `separators` between them), or None."""
    values: list[object] = []
    i, n = 0, len(text)
    while True:
        while i < n and (text[i].isspace() or text[i] in separators):
            i += 1
        if i == n:
            return values or None
        try:
            value, i = _DECODER.raw_decode(text, i)
        except ValueError:
            return None
        values.append(value)


def calls_from_values(values: list[object] | None, tool_names: frozenset[str] | None) -> list[ToolCall] | None:
    """Each value a call object or a list of them; None unless every one is a valid call."""
    if not values:
        return None
    flat: list[object] = []
    for value in values:
        flat.extend(value if isinstance(value, list) else [value])
    calls = [call_from_object(obj, tool_names) for obj in flat]
    if not calls or any(c is None for c in calls):
        return None
    return [c for c in calls if c is not None]
