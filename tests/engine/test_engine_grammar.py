"""Constrained decoding in the engine, on the tiny random Gemma: the grammar alone makes its
gibberish valid JSON for a schema (several seeds, temperature 1), `json_object` gives an object,
a bad grammar is refused at add time, and preemption keeps matchers in step with the output."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from freetoken.config import EngineConfig
from freetoken.engine.build import build_engine_for
from freetoken.engine.engine import RequestRefused
from freetoken.request import FinishReason, Request, SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
    },
    "required": ["name", "age", "color", "tags"],
    "additionalProperties": False,
}
GRAMMAR = ("json_schema", json.dumps(SCHEMA))
MAX_TOKENS = 120  # the schema's bounds keep every valid output far shorter


def _engine(loaded, pages: int = 400, running: int = 8):  # noqa: ANN001, ANN202 - fixtures' types
    config = EngineConfig(
        model="tiny", dtype="float64", page_size=4, num_tokens=4 * pages, max_running_requests=running,
        max_prefill_length=16, debug_kv=True,
    )
    return build_engine_for(config, loaded)


def _run(engine, reqs: list[Request]) -> None:  # noqa: ANN001
    for r in reqs:
        engine.add_request(r)
    while engine.has_work():
        engine.step()


def test_json_schema_output_validates_for_several_seeds(tiny_gemma, make_llm) -> None:  # noqa: ANN001
    llm = make_llm(tiny_gemma)
    prompts = ["Describe a person as JSON.", "hello", "{\"name\":"]
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=seed, grammar=GRAMMAR) for seed in range(6)]
    outs = llm.generate([prompts[i % 3] for i in range(6)], params)
    texts = set()
    for out in outs:
        assert out.finish_reason == "stop", out
        value = json.loads(out.text)
        jsonschema.validate(value, SCHEMA)
        texts.add(out.text)
        assert out.token_ids[-1] not in llm.tokenizer.stop_ids  # complete at "}", no EOS needed
    assert len(texts) > 1  # the seeds really sampled


def test_unconstrained_output_is_not_json(tiny_gemma, make_llm) -> None:  # noqa: ANN001
    """The control: without the grammar the same model and seeds give no such object."""
    llm = make_llm(tiny_gemma)
    outs = llm.generate(["Describe a person as JSON."] * 3, [SamplingParams(max_tokens=20, seed=s) for s in range(3)])
    for out in outs:
        with pytest.raises(ValueError):
            json.loads(out.text)


def test_json_object_gives_an_object(tiny_gemma, make_llm) -> None:  # noqa: ANN001
    llm = make_llm(tiny_gemma)
    # A free-form object has unbounded strings, so a random model needs a generous budget; these
    # seeds close their object well within it (seeded draws are reproducible).
    params = [SamplingParams(max_tokens=200, temperature=1.0, seed=s, grammar=("json_object", "")) for s in (0, 2)]
    outs = llm.generate(["{}"] * 2, params)
    for out in outs:
        assert out.finish_reason == "stop", out.text
        assert isinstance(json.loads(out.text), dict), out.text


@pytest.mark.parametrize(
    "grammar", [("json_schema", "{oops"), ("json_schema", '{"type": "nonsense"}'), ("lark", "start: nowhere"), ("regex", "(")]
)
def test_bad_grammar_is_refused_at_add_time(tiny_gemma, grammar) -> None:  # noqa: ANN001
    engine = _engine(tiny_gemma)
    with pytest.raises(RequestRefused) as err:
        engine.add_request(Request("bad", [5, 6, 7], SamplingParams(grammar=grammar)))
    assert err.value.param == "response_format" and err.value.code == "invalid_grammar"
    assert not engine.has_work() and len(engine.grammars) == 0
    _run(engine, [Request("ok", [5, 6, 7], SamplingParams(max_tokens=3))])  # the engine serves on


def test_regex_and_lark_kinds(tiny_gemma) -> None:  # noqa: ANN001
    engine = _engine(tiny_gemma)
    reqs = [
        Request("re", [5, 6, 7], SamplingParams(max_tokens=20, seed=1, grammar=("regex", "(yes|no)-[0-9]{2}"))),
        Request("lark", [5, 6, 7], SamplingParams(max_tokens=20, seed=2, grammar=("lark", 'start: "A" ("B" | "C")+ "!"'))),
    ]
    _run(engine, reqs)
    tok = tiny_gemma.tokenizer
    assert re.fullmatch(r"(yes|no)-[0-9]{2}", tok.decode(reqs[0].output_ids))
    assert reqs[0].finish_reason is FinishReason.STOP
    text = tok.decode(reqs[1].output_ids, skip_special_tokens=True)
    assert re.fullmatch(r"A[BC]+!", text), text
    assert len(engine.grammars) == 0  # finished requests drop their matchers


def test_preemption_keeps_matchers_in_step(tiny_gemma) -> None:  # noqa: ANN001
    """Seeded constrained outputs are the same with a pool that forces preemption (matchers
    follow output ids, which survive it), and every output is valid."""
    prompts = [[(7 * i + j) % 300 + 3 for j in range(10 + 3 * i)] for i in range(4)]
    outs = {}
    for pages in (400, 30):
        engine = _engine(tiny_gemma, pages=pages, running=4)
        reqs = [Request(f"q{i}", p, SamplingParams(max_tokens=100, temperature=1.0, seed=i, grammar=GRAMMAR))
                for i, p in enumerate(prompts)]
        _run(engine, reqs)
        if pages == 30:
            assert engine.scheduler.preemptions > 0, "the pool was meant to force preemption"
        for r in reqs:
            assert r.finish_reason is FinishReason.STOP, r.error
            jsonschema.validate(json.loads(tiny_gemma.tokenizer.decode(r.output_ids)), SCHEMA)
        outs[pages] = [r.output_ids for r in reqs]
        assert len(engine.grammars) == 0
    assert outs[400] == outs[30]


def test_the_engine_builds_its_tokenizer_only_when_a_grammar_needs_it(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """The engine process needs a tokenizer only to compile a grammar, and a large vocabulary
    takes seconds to build (Gemma 3's: ~3 s of every start): a load and unconstrained requests
    never build it, the first constrained request does, once."""
    import torch
    from tiny_models import write_tiny_model

    import freetoken.models.load as load_module

    built = []
    real = load_module.load_tokenizer
    monkeypatch.setattr(load_module, "load_tokenizer", lambda *args: built.append(args) or real(*args))
    loaded = load_module.load_model(str(write_tiny_model("gemma3", tmp_path)), torch.float64, torch.device("cpu"))
    engine = _engine(loaded)
    _run(engine, [Request("plain", [2, 5, 7], SamplingParams(max_tokens=3, temperature=0.0))])
    assert built == []
    constrained = [
        Request(f"json{i}", [2, 5, 7], SamplingParams(max_tokens=8, temperature=1.0, seed=i, grammar=("json_object", "")))
        for i in range(2)
    ]
    _run(engine, constrained)
    assert all(r.output_ids for r in constrained)
    assert len(built) == 1 and loaded.tokenizer is loaded.tokenizer and len(built) == 1
