"""Tokenizer built from tiny synthetic GGUF metadata: ids worked out by hand from the merge rules."""

from __future__ import annotations

import pytest

from freetoken.errors import ModelLoadError
from freetoken.tokenizer import Tokenizer
from freetoken.families.gemma3 import CHAT_TEMPLATE as GEMMA3_CHAT_TEMPLATE
from freetoken.tokenizer.gguf_vocab import merges_from_vocab


def test_merges_from_vocab_rank_by_priority_then_longer_left() -> None:
    tokens = ["a", "b", "c", "ab", "bc", "abc"]
    priority = [0, 0, 0, 5, 1, 3]
    assert merges_from_vocab(tokens, priority) == [("a", "b"), ("ab", "c"), ("a", "bc"), ("b", "c")]


def test_spm_gemma_layout_ids(tiny_spm: Tokenizer, spm_piece_id) -> None:
    p = spm_piece_id
    # spaces become U+2581 before the model; "▁a" outranks "ab", then "▁a"+"b" makes "▁ab"
    assert tiny_spm.encode("ab ab") == [2, p("ab"), p("\u2581ab")]
    # a run of two spaces is stored as "  " in the file and still found
    assert tiny_spm.encode("abc  x") == [2, p("abc"), p("  "), p("x")]
    # the user-defined "\n" and control tokens are matched whole
    assert tiny_spm.encode("a\nb") == [2, p("a"), 6, p("b")]
    assert tiny_spm.encode("<start_of_turn>ab") == [2, 4, p("ab")]
    # byte fallback for a character the vocabulary lacks
    assert tiny_spm.encode("你", add_special_tokens=False) == [p(0xE4), p(0xBD), p(0xA0)]
    assert tiny_spm.encode("é", add_special_tokens=False) == [p("é")]
    assert tiny_spm.encode("") == [2]
    assert tiny_spm.encode("", add_special_tokens=False) == []


def test_spm_gemma_layout_decode_and_specials(tiny_spm: Tokenizer, spm_piece_id) -> None:
    p = spm_piece_id
    ids = [2, p("ab"), p("\u2581ab"), p(0xE4), p(0xBD), p(0xA0), 5]
    assert tiny_spm.decode(ids) == "<bos>ab ab你<end_of_turn>"
    assert tiny_spm.decode(ids, skip_special_tokens=True) == "ab ab你"
    for text in ["ab ab", "  x\n\nabc", "héllo 你好 🙂", " leading", "trailing  "]:
        assert tiny_spm.decode(tiny_spm.encode(text), skip_special_tokens=True) == text
    assert (tiny_spm.bos_id, tiny_spm.eos_id, tiny_spm.pad_id) == (2, 1, 0)
    assert tiny_spm.bos_token == "<bos>" and tiny_spm.eos_token == "<eos>"
    assert tiny_spm.stop_ids == {1, 5}
    assert tiny_spm.vocab_size == 7 + 256 + 12
    assert tiny_spm.special_ids == {0, 1, 2, 4, 5}
    assert tiny_spm.byte_fallback_ids == set(range(7, 7 + 256))
    assert tiny_spm.id_to_token(p("\u2581ab")) == "\u2581ab"
    assert tiny_spm.token_to_id("<end_of_turn>") == 5
    assert tiny_spm.chat_template == GEMMA3_CHAT_TEMPLATE


def test_spm_llama_layout_prefix_space(tiny_llama_spm: Tokenizer, spm_piece_id) -> None:
    p = spm_piece_id
    assert tiny_llama_spm.encode("ab ab") == [2, p("\u2581ab"), p("\u2581ab")]
    assert tiny_llama_spm.decode(tiny_llama_spm.encode("ab ab"), skip_special_tokens=True) == "ab ab"
    # no template in the file and none built in for llama
    assert tiny_llama_spm.chat_template is None


def test_byte_level_bpe_ids(tiny_bpe: Tokenizer) -> None:
    assert tiny_bpe.encode(" the") == [261]
    assert tiny_bpe.encode("the") == [ord("t"), 260]
    # GPT-2 splitting: the last space of a run goes with the next word
    assert tiny_bpe.encode("a  b") == [ord("a"), 32, 32, ord("b")]
    assert tiny_bpe.encode("a   b") == [ord("a"), 262, 32, ord("b")]
    assert tiny_bpe.encode("é") == [0xC3, 0xA9]
    assert tiny_bpe.encode("<|im_end|>x") == [258, ord("x")]
    assert tiny_bpe.encode("") == []
    assert (tiny_bpe.bos_id, tiny_bpe.eos_id, tiny_bpe.prefix_ids) == (256, 258, ())
    assert tiny_bpe.stop_ids == {256, 258}
    assert tiny_bpe.byte_fallback_ids == frozenset()
    for text in ["the  cat\n\tsat", "héllo 你好 🙂", ""]:
        assert tiny_bpe.decode(tiny_bpe.encode(text)) == text


def test_add_flags_and_extra_stop_ids(spm_metadata: dict) -> None:
    spm_metadata["tokenizer.ggml.add_bos_token"] = False
    spm_metadata["tokenizer.ggml.add_eos_token"] = True
    spm_metadata["tokenizer.ggml.eot_token_id"] = 4
    tok = Tokenizer.from_gguf_metadata(spm_metadata)
    assert tok.encode("x") == [tok.token_to_id("x"), 1]
    assert tok.stop_ids == {1, 4, 5}


def test_chat_template_from_metadata_wins_over_builtin(spm_metadata: dict) -> None:
    spm_metadata["tokenizer.chat_template"] = "{{ messages[0]['content'] }}"
    tok = Tokenizer.from_gguf_metadata(spm_metadata)
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "hi"


def test_missing_vocabulary_is_a_load_error(spm_metadata: dict) -> None:
    del spm_metadata["tokenizer.ggml.tokens"]
    with pytest.raises(ModelLoadError, match="no tokenizer vocabulary"):
        Tokenizer.from_gguf_metadata(spm_metadata)


def test_unsupported_tokenizer_model_is_a_load_error(spm_metadata: dict) -> None:
    spm_metadata["tokenizer.ggml.model"] = "rwkv"
    with pytest.raises(ModelLoadError, match="unsupported GGUF tokenizer model 'rwkv'"):
        Tokenizer.from_gguf_metadata(spm_metadata)


def test_bad_merge_line_is_a_load_error(bpe_metadata: dict) -> None:
    bpe_metadata["tokenizer.ggml.merges"] = ["Ġ t x"]
    with pytest.raises(ModelLoadError, match="not two tokens"):
        Tokenizer.from_gguf_metadata(bpe_metadata)
