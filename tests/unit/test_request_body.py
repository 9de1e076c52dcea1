"""The request-body checks of `server/request_body.py` and `server/core/grammar_check.py`, without a
server: the depth scan honours strings and escapes, lone surrogates are found with their path and
pairs are not, and the `$ref` productivity check refuses exactly the schemas with no finite value."""

from __future__ import annotations

import json
from typing import Any

import pytest

from freetoken.server.core.grammar_check import grammar_problem, unsatisfiable_ref
from freetoken.server.errors import APIError
from freetoken.server.request_body import decode_json_object, json_depth_exceeds, lone_surrogate_at


@pytest.mark.parametrize(
    ("text", "depth"),
    [
        ('{"a": [1, [2, {"b": []}]]}', 5),
        ('{"a": "[[[[[[[[[[[[[["}', 1),  # brackets inside a string are text
        ('{"a": "\\"[[[[[[[[[", "b": [[]]}', 3),  # an escaped quote does not end the string
        ('{"a": "\\\\", "b": [[[]]]}', 4),  # an escaped backslash before the closing quote
        ('{"k[": {"k{": "]]]]"}}', 2),
        ("[]", 1),
        ('"just a string"', 0),
    ],
)
def test_depth_scan(text: str, depth: int) -> None:
    raw = text.encode()
    assert json_depth_exceeds(raw, depth) is False
    assert json_depth_exceeds(raw, depth - 1) is True


def test_depth_scan_handles_huge_nesting_without_recursion() -> None:
    raw = b"[" * 1_000_000 + b"]" * 1_000_000
    assert json_depth_exceeds(raw, 128)
    with pytest.raises(APIError) as info:
        decode_json_object(raw)
    assert info.value.status == 400 and info.value.code == "json_too_deep" and "128" in info.value.message


def test_lone_surrogates_found_with_their_path() -> None:
    assert lone_surrogate_at(json.loads('{"a": [{"b": "ok"}, {"c": "x\\ud800"}]}')) == ("a", 1, "c")
    assert lone_surrogate_at(json.loads('{"\\udc00": 1}')) == ()
    assert lone_surrogate_at(json.loads('{"a": "\\ud83d\\ude00", "b": ["\\u00e9"]}')) is None
    with pytest.raises(APIError) as info:
        decode_json_object(b'{"messages": [{"content": "\\ud800"}]}')
    assert (info.value.status, info.value.param, info.value.code) == (400, "messages[0].content", "invalid_unicode")
    with pytest.raises(APIError) as info:  # a surrogate encoded as UTF-8 bytes (json.loads lets it through)
        decode_json_object('{"p": "x"}'.encode().replace(b"x", "\ud800".encode("utf-8", "surrogatepass")))
    assert info.value.param == "p"
    assert decode_json_object('{"p": "\U0001F600"}'.encode()) == {"p": "\U0001F600"}


@pytest.mark.parametrize("raw", [b"[1]", b"not json", b'{"a": ', b"\xff\xfe"])
def test_not_an_object_or_not_json(raw: bytes) -> None:
    with pytest.raises(APIError) as info:
        decode_json_object(raw)
    assert info.value.status == 400 and info.value.code == "invalid_json"


DEFS_CYCLE = {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}}


@pytest.mark.parametrize(
    ("schema", "where"),
    [
        (DEFS_CYCLE, "#"),
        ({"$ref": "#"}, "#"),
        ({"type": "object", "properties": {"x": {"$ref": "#"}}, "required": ["x"]}, "#/properties/x"),
        ({"type": "array", "minItems": 1, "items": {"$ref": "#"}}, "#/items"),
        ({"anyOf": [{"$ref": "#"}, {"$ref": "#/anyOf/0"}]}, "#/anyOf/0"),
        ({"type": "object", "properties": {"next": {"anyOf": [{"type": "null"}, {"$ref": "#"}]}}, "required": ["next"]}, None),
        ({"type": "object", "properties": {"x": {"$ref": "#/$defs/a"}}, "$defs": {"a": {"$ref": "#/$defs/a"}}}, None),
        ({"type": "array", "items": {"$ref": "#"}}, None),
        ({"type": "string"}, None),
        ({"$ref": "https://example.com/schema"}, None),  # remote: the compiler's to judge
    ],
)
def test_unsatisfiable_ref(schema: dict[str, Any], where: str | None) -> None:
    assert unsatisfiable_ref(schema) == where


def test_long_ref_chain_in_any_order_is_linear() -> None:
    n = 50_000
    defs = {f"a{i}": {"$ref": f"#/$defs/a{i + 1}"} for i in range(n)}
    defs[f"a{n}"] = {"type": "string"}
    for order in (list(defs.items()), list(reversed(defs.items()))):
        assert unsatisfiable_ref({"$ref": "#/$defs/a0", "$defs": dict(order)}) is None
    defs[f"a{n}"] = {"$ref": "#/$defs/a0"}
    assert unsatisfiable_ref({"$ref": "#/$defs/a0", "$defs": defs}) is not None


def test_grammar_problem() -> None:
    assert grammar_problem("json_schema", json.dumps({"type": "object"})) is None
    assert grammar_problem("json_object", "") is None
    assert grammar_problem("regex", "a+") is None
    assert "$ref" in str(grammar_problem("json_schema", json.dumps(DEFS_CYCLE)))
    assert grammar_problem("json_schema", json.dumps({"type": 5})) is not None
    assert grammar_problem("json_schema", "{not json") is not None
    assert grammar_problem("lark", "start: x\nx: x") is not None  # no sentence at all
