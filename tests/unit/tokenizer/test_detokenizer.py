"""The incremental detokenizer: streamed text equals decode(all ids), UTF-8 safety, stop strings."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from freetoken.tokenizer import IncrementalDetokenizer, Tokenizer


def stream(tok: Tokenizer, ids: list[int], **options) -> tuple[list[str], IncrementalDetokenizer]:
    """Feed ids one at a time; the pieces emitted, the final flush last."""
    detok = IncrementalDetokenizer(tok, **options)
    pieces = [detok.add(i).text for i in ids]
    pieces.append(detok.finish().text)
    return pieces, detok


@settings(max_examples=200, deadline=None)
@given(ids=st.lists(st.integers(min_value=0, max_value=7 + 256 + 11), max_size=24), skip=st.booleans())
def test_spm_stream_equals_decode(tiny_spm: Tokenizer, ids: list[int], skip: bool) -> None:
    pieces, _ = stream(tiny_spm, ids, skip_special_tokens=skip)
    assert "".join(pieces) == tiny_spm.decode(ids, skip_special_tokens=skip)


@settings(max_examples=200, deadline=None)
@given(ids=st.lists(st.integers(min_value=0, max_value=262), max_size=24))
def test_byte_level_stream_equals_decode(tiny_bpe: Tokenizer, ids: list[int]) -> None:
    pieces, _ = stream(tiny_bpe, ids)
    assert "".join(pieces) == tiny_bpe.decode(ids)


@settings(max_examples=100, deadline=None)
@given(ids=st.lists(st.integers(min_value=0, max_value=7 + 256 + 11), max_size=16))
def test_llama_spm_stream_equals_decode(tiny_llama_spm: Tokenizer, ids: list[int]) -> None:
    # the decoder strips the first token's leading space: only the first window may do that
    pieces, _ = stream(tiny_llama_spm, ids, skip_special_tokens=True)
    assert "".join(pieces) == tiny_llama_spm.decode(ids, skip_special_tokens=True)


def test_multibyte_character_split_over_byte_fallback_tokens(tiny_spm: Tokenizer, spm_piece_id) -> None:
    p = spm_piece_id
    ids = [p("ab"), p(0xF0), p(0x9F), p(0x99), p(0x82), p("\u2581x")]  # ab🙂 x
    pieces, _ = stream(tiny_spm, ids)
    # nothing of the emoji is emitted until the byte run is closed by a non-byte token
    assert pieces == ["ab", "", "", "", "", "🙂 x", ""]
    # a run that turns out invalid becomes one U+FFFD per byte, as decode does
    pieces, _ = stream(tiny_spm, [p(0xE4), p(0xBD), p("x")])
    assert pieces == ["", "", "\ufffd\ufffdx", ""]
    # an unfinished run at the end is flushed by finish()
    pieces, _ = stream(tiny_spm, [p("x"), p(0xE4)])
    assert pieces == ["x", "", "\ufffd"]


def test_byte_level_holds_incomplete_utf8(tiny_bpe: Tokenizer) -> None:
    ids = tiny_bpe.encode("a你b")  # byte-level: 你 is three byte tokens
    assert len(ids) == 5
    pieces, _ = stream(tiny_bpe, ids)
    assert pieces == ["a", "", "", "你", "b", ""]


def test_window_stays_small(tiny_bpe: Tokenizer) -> None:
    """Each step decodes a short trailing window, never the whole sequence."""
    seen: list[int] = []

    class Spy(Tokenizer):
        def decode(self, ids, *, skip_special_tokens=False):
            seen.append(len(ids))
            return super().decode(ids, skip_special_tokens=skip_special_tokens)

    spy = Tokenizer.__new__(Spy)
    spy.__dict__.update(tiny_bpe.__dict__)
    ids = tiny_bpe.encode("the cat sat on the mat " * 20)
    pieces, _ = stream(spy, ids)
    assert "".join(pieces) == tiny_bpe.decode(ids)
    assert len(ids) > 100 and max(seen) <= 3


def test_context_ids_keep_the_leading_space(tiny_llama_spm: Tokenizer, spm_piece_id) -> None:
    ab = spm_piece_id("\u2581ab")
    bare, _ = stream(tiny_llama_spm, [ab])
    assert "".join(bare) == "ab"  # decoded alone, the first token's space is stripped
    after_prompt, _ = stream(tiny_llama_spm, [ab], context_ids=[2, ab])
    assert "".join(after_prompt) == " ab"


def test_stop_string_across_token_boundaries(tiny_bpe: Tokenizer) -> None:
    ids = tiny_bpe.encode("say the end now")
    pieces, detok = stream(tiny_bpe, ids, stop=["he en"])
    assert "".join(pieces) == "say t"
    assert detok.stop_string == "he en" and detok.stopped
    # ids after the stop are ignored
    assert detok.add(ord("z")).text == ""


def test_partial_stop_match_is_held_then_released(tiny_bpe: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tiny_bpe, stop=["STOP"])
    out = [detok.add(i).text for i in tiny_bpe.encode("aST")]
    assert out == ["a", "", ""]  # "S", "ST" could start "STOP"
    delta = detok.add(ord("x"))
    assert delta.text == "STx" and delta.stop_string is None
    out = [detok.add(i).text for i in tiny_bpe.encode("bSTO")]
    assert out == ["b", "", "", ""]
    assert detok.finish().text == "STO"  # the end of generation releases a held partial match
    assert detok.text == "aSTxbSTO"


def test_stop_string_inside_one_token_and_reported(tiny_bpe: Tokenizer) -> None:
    the = tiny_bpe.encode(" the")
    assert len(the) == 1
    detok = IncrementalDetokenizer(tiny_bpe, stop=["h"])
    assert detok.add(ord("x")).text == "x"
    delta = detok.add(the[0])
    assert (delta.text, delta.stop_string) == (" t", "h")
    assert detok.finish().text == ""


def test_earliest_completed_stop_wins_and_include_stop(tiny_bpe: Tokenizer) -> None:
    ids = tiny_bpe.encode("xabcd")
    pieces, detok = stream(tiny_bpe, ids, stop=["abcd", "bc"])
    assert ("".join(pieces), detok.stop_string) == ("xa", "bc")
    pieces, detok = stream(tiny_bpe, ids, stop=["bc"], include_stop_string=True)
    assert "".join(pieces) == "xabc"


def test_skip_special_tokens(tiny_bpe: Tokenizer) -> None:
    ids = [256, *tiny_bpe.encode("hi"), 258]
    assert "".join(stream(tiny_bpe, ids)[0]) == "<|endoftext|>hi<|im_end|>"
    assert "".join(stream(tiny_bpe, ids, skip_special_tokens=True)[0]) == "hi"


def test_stop_string_made_of_a_multibyte_character(tiny_bpe: Tokenizer) -> None:
    ids = tiny_bpe.encode("a🙂b")
    pieces, detok = stream(tiny_bpe, ids, stop=["🙂"])
    assert "".join(pieces) == "a" and detok.stop_string == "🙂"


def test_hidden_ids_are_never_text_even_with_special_tokens_kept(tmp_path) -> None:
    """The end-of-generation token a request stopped on is no text, while other special tokens
    (a format's markers) are kept."""
    from freetoken.tokenizer.testing import write_tiny_tokenizer

    tok = Tokenizer.from_pretrained_dir(write_tiny_tokenizer(tmp_path))
    ids = tok.encode("<|im_start|>hi", add_special_tokens=False) + [tok.eos_id]
    kept = IncrementalDetokenizer(tok, skip_special_tokens=False)
    assert "".join(kept.add(i).text for i in ids) + kept.finish().text == "<|im_start|>hi<|im_end|>"
    hidden = IncrementalDetokenizer(tok, skip_special_tokens=False, hidden_ids={tok.eos_id})
    assert "".join(hidden.add(i).text for i in ids) + hidden.finish().text == "<|im_start|>hi"
