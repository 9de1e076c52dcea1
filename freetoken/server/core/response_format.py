"""OpenAI's `response_format` -> the engine's `SamplingParams.grammar`.

Owns the shapes `/v1/chat/completions` and `/v1/completions` accept: `{"type": "text"}` (no
constraint), `{"type": "json_object"}` (any JSON object) and `{"type": "json_schema",
"json_schema": {"name", "schema", "strict", "description"}}` (the schema, enforced whatever
`strict` says). Shape errors are 400s naming `response_format`, and so is a schema the grammar
compiler cannot use (`grammar_check`: it does not compile, or a `$ref` cycle admits no value).
"""

from __future__ import annotations

import json
from typing import Any

from freetoken.server.core.grammar_check import check_grammar
from freetoken.server.errors import bad_request

PARAM = "response_format"
_SCHEMA_KEYS = {"name", "schema", "strict", "description"}


def grammar_of(response_format: dict[str, Any] | None) -> tuple[str, str] | None:
    """The engine grammar `(kind, text)` for a `response_format` body, or None for plain text."""
    if response_format is None:
        return None
    kind = response_format.get("type")
    extra = set(response_format) - {"type", "json_schema"}
    if extra:
        raise bad_request(f"response_format: unknown field {sorted(extra)[0]!r}", param=PARAM)
    if kind == "text":
        return None
    if kind == "json_object":
        return ("json_object", "")
    if kind != "json_schema":
        raise bad_request(
            f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}", param=PARAM
        )
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict):
        raise bad_request("response_format.json_schema must be an object with 'name' and 'schema'", param=PARAM)
    unknown = set(spec) - _SCHEMA_KEYS
    if unknown:
        raise bad_request(f"response_format.json_schema: unknown field {sorted(unknown)[0]!r}", param=PARAM)
    if not isinstance(spec.get("name"), str) or not spec["name"]:
        raise bad_request("response_format.json_schema.name must be a non-empty string", param=PARAM)
    schema = spec.get("schema", {})  # OpenAI lets it be omitted: any JSON value
    if not isinstance(schema, (dict, bool)):
        raise bad_request("response_format.json_schema.schema must be a JSON schema object", param=PARAM)
    if "strict" in spec and spec["strict"] is not None and not isinstance(spec["strict"], bool):
        raise bad_request("response_format.json_schema.strict must be a boolean", param=PARAM)
    grammar = ("json_schema", json.dumps(schema))
    check_grammar(grammar, PARAM)  # a schema the engine could not enforce is refused here, not mid-generation
    return grammar
