"""`response_format` over real HTTP with the `openai` client, on the shared tiny random model: its
gibberish becomes JSON that validates against the schema (the grammar alone guarantees it),
streamed or not, on chat and completions; bad formats and schemas are 400s naming the field."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest
from conftest import API_KEY
from serving import ServeProcess

MODEL = "tiny-gemma"
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "population": {"type": "integer", "minimum": 0, "maximum": 100000},
        "size": {"enum": ["small", "large"]},
        "districts": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 3},
    },
    "required": ["city", "population", "size", "districts"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}
MESSAGES: Any = [{"role": "user", "content": "Describe a city as JSON."}]


@pytest.fixture(scope="module")
def oa(server: ServeProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base}/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(autouse=True)
def balanced_after(server: ServeProcess) -> Iterator[None]:
    """Each test, in any order, leaves the pools balanced with no new violation (a grammar that
    ends a request early must still release every page)."""
    yield
    server.assert_balanced_idle()


def test_chat_json_schema_validates(oa: openai.OpenAI) -> None:
    out = oa.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=150, temperature=1.0, n=3, seed=11, response_format=FORMAT  # type: ignore[arg-type]
    )
    texts = set()
    for choice in out.choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content or ""), SCHEMA)
        texts.add(choice.message.content)
    assert len(texts) > 1  # three seeds, three different objects


def test_chat_json_schema_streamed(oa: openai.OpenAI) -> None:
    stream = oa.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=150, temperature=1.0, seed=5, stream=True, response_format=FORMAT  # type: ignore[arg-type]
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]
    jsonschema.validate(json.loads(text), SCHEMA)


def test_completions_json_schema(oa: openai.OpenAI) -> None:
    out = oa.completions.create(
        model=MODEL, prompt="City:", max_tokens=150, temperature=1.0, seed=3, extra_body={"response_format": FORMAT}
    )
    assert out.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(out.choices[0].text), SCHEMA)


def test_logprobs_under_a_grammar_are_json(server: ServeProcess) -> None:
    """Alternatives the grammar rules out have a logprob of minus infinity: they are written as
    -9999.0 (JSON has no infinity), on completions and chat, streamed and not."""
    body = {"model": MODEL, "max_tokens": 40, "temperature": 0, "response_format": FORMAT}
    with server.http() as c:
        plain = c.post("/v1/completions", json={**body, "prompt": "City:", "logprobs": 3})
        chat = c.post("/v1/chat/completions", json={**body, "messages": MESSAGES, "logprobs": True, "top_logprobs": 3})
        streamed = c.post("/v1/chat/completions", json={**body, "messages": MESSAGES, "logprobs": True, "top_logprobs": 3, "stream": True})
    assert plain.status_code == chat.status_code == streamed.status_code == 200, (plain.text, chat.text)
    tops = [lp for top in plain.json()["choices"][0]["logprobs"]["top_logprobs"] for lp in top.values()]
    content = chat.json()["choices"][0]["logprobs"]["content"]
    tops_chat = [t["logprob"] for e in content for t in e["top_logprobs"]]
    def strict(text: str) -> Any:  # Python's json takes `-Infinity`; JSON does not
        return json.loads(text, parse_constant=lambda name: pytest.fail(f"{name} is not JSON"))

    chunks = [strict(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
    tops_streamed = [t["logprob"] for ch in chunks for choice in ch["choices"] if choice["logprobs"]
                     for e in choice["logprobs"]["content"] for t in e["top_logprobs"]]
    for found in (tops, tops_chat, tops_streamed):
        assert -9999.0 in found and min(found) == -9999.0


def test_json_object(oa: openai.OpenAI) -> None:
    """Any object: strings are unbounded, so a random model gets a generous budget; of three
    seeds, those that close their object (most do) parse as an object, and none starts otherwise."""
    out = oa.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=300, temperature=1.0, n=3, seed=0,
        response_format={"type": "json_object"},
    )
    done = [c.message.content or "" for c in out.choices if c.finish_reason == "stop"]
    assert done, [c.message.content for c in out.choices]
    for text in done:
        assert isinstance(json.loads(text), dict)
    assert all((c.message.content or "").startswith("{") for c in out.choices)


def test_text_format_is_unconstrained(oa: openai.OpenAI) -> None:
    out = oa.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=5, temperature=0, response_format={"type": "text"},
        extra_body={"ignore_eos": True},
    )
    plain = oa.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    assert out.choices[0].message.content == plain.choices[0].message.content


@pytest.mark.parametrize(
    "fmt, words",
    [
        ({"type": "xml"}, "response_format.type"),
        ({"type": "json_schema"}, "json_schema must be an object"),
        ({"type": "json_schema", "json_schema": {"schema": SCHEMA}}, "name"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}, "nonsense"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "required": ["a"],
          "additionalProperties": False}}}, "a"),
    ],
)
def test_bad_response_format_is_400(oa: openai.OpenAI, fmt: dict[str, Any], words: str) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        oa.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, response_format=fmt)  # type: ignore[arg-type]
    body: Any = err.value.body
    assert body["param"] == "response_format" and words in body["message"], body
    with pytest.raises(openai.BadRequestError):  # streamed too: refused before the stream starts
        oa.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, stream=True, response_format=fmt)  # type: ignore[arg-type]
