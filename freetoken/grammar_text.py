"""The llguidance grammar text of a request's `(kind, text)` grammar, free of torch.

Owns the JSON defaults every schema compiles with (compact separators, no free whitespace) and
the mapping of the four kinds (`freetoken.request.GRAMMAR_KINDS`) to llguidance's grammar text.
Both the engine's compiler (`engine/grammar.py`, which imports torch) and the API process's
check of a schema before it reaches the engine (`server/core/grammar_check.py`, which must not)
read it here. It compiles nothing and knows no tokenizer.
"""

from __future__ import annotations

import llguidance

JSON_DEFAULTS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def grammar_text(kind: str, text: str) -> str:
    """llguidance's grammar for `(kind, text)`. ValueError (llguidance's own) on a grammar it
    cannot read; KeyError on an unknown kind."""
    if kind == "json_schema":
        return llguidance.LLMatcher.grammar_from_json_schema(text, defaults=JSON_DEFAULTS)  # type: ignore[arg-type]
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=JSON_DEFAULTS)  # type: ignore[arg-type]
    if kind == "lark":
        return llguidance.LLMatcher.grammar_from_lark(text)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(text)
    raise KeyError(kind)
