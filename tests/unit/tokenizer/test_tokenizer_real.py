"""The tokenizers of the two bundled GGUF files against transformers 5.x loading the same file
(which matches llama.cpp token for token), plus literal ids that pin the behaviour."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from freetoken.tokenizer import IncrementalDetokenizer, Tokenizer

pytestmark = pytest.mark.real_model

HAND_CHECKED = [
    "Hello world",
    "  two  spaces",
    "héllo 你好 🙂",
    "",
    "def f(x):\n    return x\n\n",
    " leading space",
    "trailing space ",
    "line one\nline two\r\n\n\nend",
    "\tindented\n\t\tmore\n        eight spaces",
    "don't I'll we're 12345 3.14159",
    "Ünïcödé ß ñ Ωμέγα Привет مرحبا",
    "🙂🙂 👨‍👩‍👧 🫨 𝔘𝔫𝔦",
    "<start_of_turn>user\nhi<end_of_turn>\n",
    "<|im_start|>user\nhi<|im_end|>\n",
    "<bos>x<eos> [multimodal] <unused3>",
    "\u2581already\u2581marked",
]

GEMMA_PINNED = {
    "Hello world": [2, 9259, 1902],
    "  two  spaces": [2, 138, 13498, 138, 35220],
    "héllo 你好 🙂": [2, 236754, 7869, 844, 43758, 237389, 57235],
    "": [2],
    "def f(x):\n    return x\n\n": [2, 2063, 517, 236769, 236781, 1473, 107, 140, 2060, 1123, 108],
    "\U0001fae8": [2, 478, 397, 409, 406],  # byte fallback: F0 9F AB A8
}
SMOLLM2_PINNED = {
    "Hello world": [19556, 905],
    "  two  spaces": [216, 827, 216, 5600],
    "héllo 你好 🙂": [88, 2756, 31394, 216, 18645, 250, 48392, 138, 47526],
    "": [],
    "def f(x):\n    return x\n\n": [1604, 275, 24, 104, 727, 472, 1003, 1792, 1116],
}


def _random_texts(seed: int, count: int) -> list[str]:
    rng = random.Random(seed)
    alphabet = "ab xyz  \n\t.,:;()[]{}<>/'\"0123456789éßñ你好🙂𝔘\u2581_-=+*#"
    return ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40))) for _ in range(count)]


@pytest.fixture(params=["gemma", "smollm2"])
def pair(request: pytest.FixtureRequest):
    """(our tokenizer, transformers' tokenizer, pinned ids) of one real file."""
    if request.param == "gemma":
        return (
            request.getfixturevalue("gemma_tokenizer"),
            request.getfixturevalue("gemma_reference"),
            GEMMA_PINNED,
        )
    return (
        request.getfixturevalue("smollm2_tokenizer"),
        request.getfixturevalue("smollm2_reference"),
        SMOLLM2_PINNED,
    )


def test_pinned_ids(pair) -> None:
    tok, _, pinned = pair
    for text, ids in pinned.items():
        assert tok.encode(text) == ids, text


def test_ids_match_transformers(pair) -> None:
    tok, ref, _ = pair
    for text in HAND_CHECKED + _random_texts(seed=7, count=200):
        assert tok.encode(text) == ref(text)["input_ids"], repr(text)
        assert tok.encode(text, add_special_tokens=False) == ref(text, add_special_tokens=False)["input_ids"]


def test_decode_matches_transformers_and_round_trips(pair) -> None:
    tok, ref, _ = pair
    for text in HAND_CHECKED:
        ids = tok.encode(text)
        assert tok.decode(ids) == ref.decode(ids)
        assert tok.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)
        if "\u2581" not in text:  # SentencePiece decodes a literal U+2581 as a space, like transformers
            assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


def test_special_ids(gemma_tokenizer: Tokenizer, smollm2_tokenizer: Tokenizer) -> None:
    g, s = gemma_tokenizer, smollm2_tokenizer
    assert (g.vocab_size, g.bos_id, g.eos_id, g.prefix_ids) == (262144, 2, 1, (2,))
    assert g.stop_ids == {1, g.token_to_id("<end_of_turn>")} == {1, 106}
    assert len(g.byte_fallback_ids) == 256 and g.id_to_token(478) == "<0xF0>"
    assert (s.vocab_size, s.bos_id, s.eos_id, s.prefix_ids) == (49152, 1, 2, ())
    assert s.stop_ids == {0, 2}  # <|endoftext|>, <|im_end|>
    assert s.byte_fallback_ids == frozenset()


def test_smollm2_chat_template_matches_transformers(smollm2_tokenizer: Tokenizer, smollm2_reference) -> None:
    conversations = [
        [{"role": "user", "content": "Hi!"}],
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": "4"},
            {"role": "user", "content": "And 3+3?"},
        ],
    ]
    for messages in conversations:
        for generation_prompt in (True, False):
            ours = smollm2_tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt)
            theirs = smollm2_reference.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=generation_prompt
            )
            assert ours == theirs
            ids = smollm2_tokenizer.encode_chat(messages, add_generation_prompt=generation_prompt)
            assert ids == smollm2_reference(theirs, add_special_tokens=False)["input_ids"]


def test_gemma_builtin_chat_prompt_ids(gemma_tokenizer: Tokenizer) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    ids = gemma_tokenizer.encode_chat(messages)
    assert ids[:3] == [2, 105, gemma_tokenizer.token_to_id("user")]
    assert ids.count(2) == 1 and ids[-3:] == [105, gemma_tokenizer.token_to_id("model"), 107]
    assert gemma_tokenizer.decode(ids) == (
        "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
    )


def test_detokenizer_streams_real_text(pair) -> None:
    tok, _, _ = pair
    for text in HAND_CHECKED:
        ids = tok.encode(text, add_special_tokens=False)
        detok = IncrementalDetokenizer(tok)
        pieces = [detok.add(i).text for i in ids] + [detok.finish().text]
        assert "".join(pieces) == tok.decode(ids)
        assert all("\ufffd" not in p for p in pieces)


# `pair` only hands out session-scoped tokenizers, so reusing it across examples is safe.
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_detokenizer_random_ids_equal_decode(pair, data: st.DataObject) -> None:
    tok, _, _ = pair
    byte_ids = sorted(tok.byte_fallback_ids) or list(range(100, 400))
    any_id = st.integers(min_value=0, max_value=tok.vocab_size - 1)
    ids = data.draw(st.lists(st.one_of(any_id, st.sampled_from(byte_ids)), max_size=20))
    skip = data.draw(st.booleans())
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
    pieces = [detok.add(i).text for i in ids] + [detok.finish().text]
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=skip)
