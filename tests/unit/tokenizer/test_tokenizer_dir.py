"""Tokenizer.from_pretrained_dir and the tiny tokenizer factory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import processors

from freetoken.errors import ModelLoadError
from freetoken.tokenizer import NoChatTemplate, Tokenizer
from freetoken.families.gemma3 import CHAT_TEMPLATE as GEMMA3_CHAT_TEMPLATE
from freetoken.tokenizer.testing import CHATML_TEMPLATE, write_tiny_tokenizer


def _update_json(path: Path, **values: object) -> None:
    data = json.loads(path.read_text()) if path.is_file() else {}
    data.update(values)
    path.write_text(json.dumps(data))


@pytest.mark.parametrize("size", [259, 300, 512])
def test_tiny_tokenizer_loads_with_the_requested_vocab_size(tmp_path: Path, size: int) -> None:
    tok = Tokenizer.from_pretrained_dir(write_tiny_tokenizer(tmp_path, vocab_size=size))
    assert tok.vocab_size == size
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.prefix_ids) == (0, 2, 0, ())
    assert tok.stop_ids == {0, 2}
    ids = tok.encode("Hello, the world! héllo 🙂\n  x")
    assert max(ids) < size
    assert tok.decode(ids) == "Hello, the world! héllo 🙂\n  x"
    assert tok.chat_template == CHATML_TEMPLATE


def test_tiny_tokenizer_is_deterministic_and_merges(tmp_path: Path) -> None:
    a = write_tiny_tokenizer(tmp_path / "a", vocab_size=320)
    b = write_tiny_tokenizer(tmp_path / "b", vocab_size=320)
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()
    tok = Tokenizer.from_pretrained_dir(a)
    assert len(tok.encode("the quick brown fox")) < len("the quick brown fox")


def test_tiny_tokenizer_chat_and_bos(tmp_path: Path) -> None:
    tok = Tokenizer.from_pretrained_dir(write_tiny_tokenizer(tmp_path, add_bos=True))
    assert tok.encode("hi")[0] == 0 and tok.encode("hi", add_special_tokens=False)[0] != 0
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode_chat([{"role": "user", "content": "hi"}])
    assert ids[0] == 1 and ids.count(2) == 1  # <|im_start|> first, no BOS added to a template


def test_tiny_tokenizer_rejects_a_too_small_vocab(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="at least 259"):
        write_tiny_tokenizer(tmp_path, vocab_size=100)


def test_missing_tokenizer_json(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="has no tokenizer.json"):
        Tokenizer.from_pretrained_dir(tmp_path)


def test_corrupt_files_are_load_errors(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="not a readable tokenizer"):
        Tokenizer.from_pretrained_dir(tmp_path)
    write_tiny_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("[")
    with pytest.raises(ModelLoadError, match="not valid JSON"):
        Tokenizer.from_pretrained_dir(tmp_path)


def test_post_processor_bos_is_kept_unless_the_config_says_otherwise(tmp_path: Path) -> None:
    write_tiny_tokenizer(tmp_path)
    spec = json.loads((tmp_path / "tokenizer.json").read_text())
    bos = processors.TemplateProcessing(single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", 0)])
    spec["post_processor"] = json.loads(bos.__getstate__())
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    del config["add_bos_token"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer.from_pretrained_dir(tmp_path)
    assert tok.prefix_ids == (0,) and tok.encode("x")[0] == 0 and tok.encode("x").count(0) == 1
    _update_json(tmp_path / "tokenizer_config.json", add_bos_token=False, add_eos_token=True)
    tok = Tokenizer.from_pretrained_dir(tmp_path)
    assert tok.encode("x") == [*tok.encode("x", add_special_tokens=False), 2]


def test_generation_config_eos_ids_are_stop_ids(tmp_path: Path) -> None:
    write_tiny_tokenizer(tmp_path, vocab_size=300)
    _update_json(tmp_path / "generation_config.json", eos_token_id=[2, 280])
    assert Tokenizer.from_pretrained_dir(tmp_path).stop_ids == {0, 2, 280}


def test_chat_template_sources_in_order(tmp_path: Path) -> None:
    write_tiny_tokenizer(tmp_path)
    messages = [{"role": "user", "content": "hi"}]
    _update_json(tmp_path / "tokenizer_config.json", chat_template=[{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}])
    assert Tokenizer.from_pretrained_dir(tmp_path).apply_chat_template(messages) == "D"
    _update_json(tmp_path / "chat_template.json", chat_template="J")
    assert Tokenizer.from_pretrained_dir(tmp_path).apply_chat_template(messages) == "J"
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    assert Tokenizer.from_pretrained_dir(tmp_path).apply_chat_template(messages) == "hi!"


def test_no_template_falls_back_to_the_builtin_only_for_gemma3(tmp_path: Path) -> None:
    write_tiny_tokenizer(tmp_path)
    _update_json(tmp_path / "tokenizer_config.json", chat_template=None)
    with pytest.raises(NoChatTemplate):
        Tokenizer.from_pretrained_dir(tmp_path).apply_chat_template([{"role": "user", "content": "hi"}])
    _update_json(tmp_path / "config.json", model_type="gemma3_text")
    assert Tokenizer.from_pretrained_dir(tmp_path).chat_template == GEMMA3_CHAT_TEMPLATE


def test_padding_and_truncation_in_tokenizer_json_are_ignored(tmp_path: Path) -> None:
    from tokenizers import Tokenizer as Backend

    write_tiny_tokenizer(tmp_path)
    plain = Tokenizer.from_pretrained_dir(tmp_path).encode("hello there")
    backend = Backend.from_file(str(tmp_path / "tokenizer.json"))
    backend.enable_padding(length=32, pad_id=0, pad_token="<|endoftext|>")
    backend.enable_truncation(max_length=2)
    backend.save(str(tmp_path / "tokenizer.json"))
    assert len(plain) > 2
    assert Tokenizer.from_pretrained_dir(tmp_path).encode("hello there") == plain
