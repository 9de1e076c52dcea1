"""The `gemma4` GGUF vocabulary: a tiny one written with the `gguf` package the way llama.cpp's
converter writes Gemma 4 (the vocabulary as `tokenizer.json` spells it, its merges, the chat markup
tokens user-defined), read back and compared with the `tokenizers` BPE that transformers'
`GemmaTokenizer` builds from the same data."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
from tokenizers import AddedToken, Tokenizer as Backend, decoders, models, normalizers, pre_tokenizers

from freetoken.errors import ModelLoadError
from freetoken.tokenizer import Tokenizer
from freetoken.weights.gguf_metadata import read_metadata

S = "\u2581"
# Ids 0-6 the control tokens of Gemma 4's tokenizer.json (with the turn markers), 7-13 its channel
# and tool markup (the converter marks them user-defined so they render), 14 "\n" (an added token),
# then the bytes.
HEAD = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<|turn>", "<turn|>", "<|channel>", "<channel|>",
        "<|tool_call>", "<tool_call|>", '<|"|>', "<|tool_response>", "<tool_response|>", "\n"]
HEAD_TYPES = [3, 3, 3, 2, 3, 3, 3, 4, 4, 4, 4, 4, 4, 4, 4]
MERGES = [f"{S} h", "h e", "l l", f"{S}h e", "ll o", f"{S}he llo", "o r", f"{S} w", f"{S}w or", "l d",
          f"{S}wor ld", f"{S} {S}", f"{S}{S} {S}", "é t", "ét é", f"{S} été", "1 2"]


def _pieces() -> list[str]:
    base = [S, "h", "e", "l", "o", "w", "r", "d", "é", "t", "1", "2", "x"]
    merged = ["".join(m.split(" ", 1)) for m in MERGES]
    out: list[str] = []
    for p in base + merged:
        if p not in out:
            out.append(p)
    return out


PIECES = _pieces()
TOKENS = HEAD + [f"<0x{b:02X}>" for b in range(256)] + PIECES
TYPES = HEAD_TYPES + [6] * 256 + [1] * len(PIECES)


def write_gemma4_vocab(path: Path) -> None:
    """As convert_hf_to_gguf.py's Gemma 4 `set_vocab` writes it (vocabulary only)."""
    w = gguf.GGUFWriter(str(path), arch="gemma4")
    w.add_tokenizer_model("gemma4")
    w.add_token_list(TOKENS)
    w.add_token_scores([0.0] * len(TOKENS))
    w.add_token_types(TYPES)
    w.add_token_merges(MERGES)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    w.add_add_space_prefix(False)
    w.add_add_bos_token(True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def reference_backend() -> Backend:
    """transformers' GemmaTokenizer pipeline over the same vocabulary and merges, plus the
    control / user-defined tokens as transformers' GGUF loader adds them."""
    vocab = {t: i for i, t in enumerate(TOKENS)}
    merges = [tuple(m.split(" ", 1)) for m in MERGES]
    ref = Backend(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True, dropout=None))
    ref.normalizer = normalizers.Replace(" ", S)
    ref.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False)
    ref.decoder = decoders.Sequence([decoders.Replace(S, " "), decoders.ByteFallback(), decoders.Fuse()])
    ref.add_special_tokens([AddedToken(t, normalized=False, special=True) for t, k in zip(TOKENS, TYPES) if k == 3])
    ref.add_tokens([AddedToken(t, normalized=False, special=False) for t, k in zip(TOKENS, TYPES) if k == 4])
    return ref


@pytest.fixture(scope="module")
def gemma4(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    path = tmp_path_factory.mktemp("gemma4") / "vocab.gguf"
    write_gemma4_vocab(path)
    return Tokenizer.from_gguf_metadata(read_metadata(path))


TEXTS = [
    "hello world",
    " hello  world ",
    "hello\nworld\n\n",
    "été 12 x",
    "中文 and ☃",  # no pieces: byte fallback
    '<|turn>user\nhello<turn|>\n<|turn>model\n<|channel>thought\nhe<channel|><|tool_call>call:w{a:<|"|>x<|"|>}<tool_call|>',
    "<bos>hello<eos>",
    "    ",
    "",
]


@pytest.mark.parametrize("text", TEXTS)
def test_ids_and_decode_match_the_reference(gemma4: Tokenizer, text: str) -> None:
    ref = reference_backend()
    want = ref.encode(text, add_special_tokens=False).ids
    got = gemma4.encode(text, add_special_tokens=False)
    assert got == want
    assert gemma4.backend.decode(got, skip_special_tokens=False) == ref.decode(want, skip_special_tokens=False)
    assert gemma4.backend.decode(got, skip_special_tokens=True) == ref.decode(want, skip_special_tokens=True)


def test_merges_and_fallback_are_used(gemma4: Tokenizer) -> None:
    ids = {t: i for i, t in enumerate(TOKENS)}
    # no space before "hello": "he" + "llo" is no merge, only "▁he" + "llo" is
    assert gemma4.encode("hello world", add_special_tokens=False) == [ids["he"], ids["llo"], ids[f"{S}world"]]
    assert gemma4.encode(" hello", add_special_tokens=False) == [ids[f"{S}hello"]]
    assert gemma4.encode("   ", add_special_tokens=False) == [ids[S * 3]]
    assert gemma4.decode([ids[S * 3], ids[f"{S}été"]]) == "    été"
    snow = gemma4.encode("☃", add_special_tokens=False)
    assert snow == [ids[f"<0x{b:02X}>"] for b in "☃".encode()]
    assert gemma4.decode(snow) == "☃"
    # the markup tokens are matched whole and rendered (user-defined), the control ones are special
    assert gemma4.encode("<|channel>x<channel|>", add_special_tokens=False) == [ids["<|channel>"], ids["x"], ids["<channel|>"]]
    markup = [ids["<|tool_call>"], ids["x"], ids["<tool_call|>"], ids["<eos>"]]
    assert gemma4.decode(markup, skip_special_tokens=True) == "<|tool_call>x<tool_call|>"
    assert gemma4.bos_id == 2 and gemma4.eos_id == 1
    # <eos>, the end of a turn and the hand-over to a tool end a generation (as llama.cpp's EOG set)
    assert gemma4.stop_ids == {1, ids["<turn|>"], ids["<|tool_response>"]}
    assert gemma4.encode("x") == [2, ids["x"]]  # the file's add_bos_token (a chat prompt is encoded without it)


def test_gemma4_without_merges_is_a_load_error(tmp_path: Path) -> None:
    path = tmp_path / "vocab.gguf"
    write_gemma4_vocab(path)
    meta = dict(read_metadata(path))
    del meta["tokenizer.ggml.merges"]
    with pytest.raises(ModelLoadError, match="merges"):
        Tokenizer.from_gguf_metadata(meta)
