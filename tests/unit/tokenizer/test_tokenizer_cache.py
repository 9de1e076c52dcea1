"""The tokenizer cache: a SentencePiece vocabulary's merges are derived once and read back on
later starts, and never trusted blindly (another vocabulary, other code, a damaged entry: derived
again, the bad entry deleted); a tokenizer built from the cache is the one built without it."""

from __future__ import annotations

import copy
import json
import logging
import os
from pathlib import Path

import numpy as np
import pytest
import xxhash

from freetoken.tokenizer import Tokenizer
from freetoken.tokenizer import cache as cache_module
from freetoken.tokenizer import gguf_vocab
from freetoken.tokenizer.cache import TokenizerCache, vocabulary_digest

TEXTS = ["ab ab", "abc  x\n", "héllo 你好", "<start_of_turn>ab"]


@pytest.fixture()
def fresh(spm_metadata: dict[str, object]):
    """Fresh copies of the tiny Gemma-layout metadata (conftest's `spm_metadata`)."""
    return lambda: copy.deepcopy(spm_metadata)


@pytest.fixture()
def derived(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many times the merges were derived (one entry per call)."""
    calls: list[int] = []
    real = gguf_vocab.merges_from_vocab

    def counted(tokens, priority):  # noqa: ANN001, ANN202
        calls.append(len(tokens))
        return real(tokens, priority)

    monkeypatch.setattr(gguf_vocab, "merges_from_vocab", counted)
    return calls


def entries(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.merges"))


def test_merges_read_back_build_the_same_tokenizer(fresh, derived, tmp_path: Path) -> None:
    cache = TokenizerCache(tmp_path)
    built = Tokenizer.from_gguf_metadata(fresh())
    first = Tokenizer.from_gguf_metadata(fresh(), cache)
    assert len(derived) == 2 and len(entries(tmp_path)) == 1
    second = Tokenizer.from_gguf_metadata(fresh(), cache)
    assert len(derived) == 2, "the second build must read the merges, not derive them"
    for tok in (first, second):
        assert tok.backend.to_str() == built.backend.to_str()
        for text in TEXTS:
            assert tok.encode(text) == built.encode(text)


def test_another_vocabulary_is_another_entry(fresh, derived, tmp_path: Path) -> None:
    metadata = fresh()
    tokens, scores = metadata["tokenizer.ggml.tokens"], metadata["tokenizer.ggml.scores"]
    assert isinstance(tokens, list) and isinstance(scores, list)
    base = vocabulary_digest(tokens, scores)
    assert vocabulary_digest([*tokens[:-1], "zz"], scores) != base
    assert vocabulary_digest(tokens, [s * 2 for s in scores]) != base
    # hashed with their lengths: moving a character from one token to the next changes it
    assert vocabulary_digest([*tokens[:-2], tokens[-2] + tokens[-1][:1], tokens[-1][1:]], scores) != base
    cache = TokenizerCache(tmp_path)
    Tokenizer.from_gguf_metadata(metadata, cache)
    changed = fresh()
    changed["tokenizer.ggml.tokens"] = [*tokens[:-1], "zz"]
    Tokenizer.from_gguf_metadata(changed, cache)
    assert len(derived) == 2 and len(entries(tmp_path)) == 2


def test_other_code_is_a_miss(fresh, derived, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = TokenizerCache(tmp_path)
    Tokenizer.from_gguf_metadata(fresh(), cache)
    monkeypatch.setattr(cache_module, "_code", lambda: "another version")
    Tokenizer.from_gguf_metadata(fresh(), cache)
    assert len(derived) == 2


def _rehashed(head: bytes, body: bytes) -> bytes:
    """`body` under `head`'s key with a digest that matches it: only the content checks can refuse it."""
    meta = json.loads(head)
    meta["xxh3_128"] = xxhash.xxh3_128_hexdigest(body)
    return json.dumps(meta).encode() + b"\n" + body


@pytest.mark.parametrize("damage", ["flip", "truncate", "garbage", "other key", "id past the vocabulary", "half a pair"])
def test_a_damaged_entry_is_deleted_and_derived_again(
    fresh, derived, tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    cache = TokenizerCache(tmp_path)
    built = Tokenizer.from_gguf_metadata(fresh(), cache)
    (entry,) = entries(tmp_path)
    raw = entry.read_bytes()
    head, body = raw.split(b"\n", 1)
    if damage == "flip":  # the ids of two merges swapped: still valid ids, only the digest sees it
        pairs = np.frombuffer(body, dtype="<i4").reshape(-1, 2).copy()
        assert len(pairs) >= 2 and not np.array_equal(pairs[0], pairs[1])
        pairs[[0, 1]] = pairs[[1, 0]]
        entry.write_bytes(head + b"\n" + pairs.tobytes())
    elif damage == "truncate":
        entry.write_bytes(raw[: len(raw) - 5])
    elif damage == "garbage":
        entry.write_bytes(b"\x00\xff not json")
    elif damage == "other key":
        meta = json.loads(head)
        meta["key"]["vocabulary"] = "0" * 32
        entry.write_bytes(json.dumps(meta).encode() + b"\n" + body)
    elif damage == "id past the vocabulary":
        pairs = np.frombuffer(body, dtype="<i4").reshape(-1, 2).copy()
        pairs[0, 1] = 1_000_000
        entry.write_bytes(_rehashed(head, pairs.tobytes()))
    else:
        entry.write_bytes(_rehashed(head, body[:-4]))
    with caplog.at_level(logging.WARNING, logger="freetoken.tokenizer"):
        again = Tokenizer.from_gguf_metadata(fresh(), cache)
    assert len(derived) == 2, "a damaged entry must not be used"
    assert "unusable" in caplog.text
    assert again.backend.to_str() == built.backend.to_str()
    (rewritten,) = entries(tmp_path)
    assert rewritten.read_bytes() == raw  # derived again and written whole


def test_off_means_no_cache_and_auto_sits_under_the_weight_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert TokenizerCache.for_setting("off") is None and TokenizerCache.for_setting(None) is None
    monkeypatch.setenv("FREETOKEN_CACHE_DIR", str(tmp_path))
    assert TokenizerCache.for_setting("auto").directory == tmp_path / "weights" / "tokenizers"  # type: ignore[union-attr]
    assert TokenizerCache.for_setting(str(tmp_path / "w")).directory == tmp_path / "w" / "tokenizers"  # type: ignore[union-attr]


def test_pruning_keeps_the_most_recently_used(fresh, derived, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cache_module, "KEEP", 2)
    cache = TokenizerCache(tmp_path)
    variants = []
    for i in range(3):
        m = fresh()
        m["tokenizer.ggml.tokens"] = [*m["tokenizer.ggml.tokens"][:-1], f"z{i}"]  # type: ignore[index]
        variants.append(m)
    Tokenizer.from_gguf_metadata(variants[0], cache)
    Tokenizer.from_gguf_metadata(variants[1], cache)
    for path in entries(tmp_path):  # both long unused ...
        os.utime(path, (1_000_000, 1_000_000))
    Tokenizer.from_gguf_metadata(variants[0], cache)  # ... then the first read (touched); a third written: the second goes
    Tokenizer.from_gguf_metadata(variants[2], cache)
    assert len(entries(tmp_path)) == 2 and len(derived) == 3
    Tokenizer.from_gguf_metadata(variants[0], cache)
    Tokenizer.from_gguf_metadata(variants[2], cache)
    assert len(derived) == 3
    Tokenizer.from_gguf_metadata(variants[1], cache)
    assert len(derived) == 4
