"""A tiny tokenizer for tests of other packages (engine, server) that run tiny random models.

Owns `write_tiny_tokenizer`, which writes a small byte-level BPE `tokenizer.json` plus a
`tokenizer_config.json` with ChatML special tokens and chat template into a directory, so that
`Tokenizer.from_pretrained_dir` loads it like a real model's. Deterministic: the same arguments
always give the same files. Not for production use.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as Backend

from freetoken.tokenizer.gguf_vocab import byte_to_unicode

TINY_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Text the merges are learned from: a little English, code and JSON, as a chat model would see.
_CORPUS = """\
The quick brown fox jumps over the lazy dog. The dog sleeps in the sun, and the fox runs away.
Hello, world! How are you today? I am fine, thank you. What is the weather like in the city?
def main(): return the answer to the question of the day; print("hello world") if it is there.
{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}} is a tool call.
"""


def _learn_merges(count: int) -> list[tuple[str, str]]:
    """Byte-level BPE merges learned greedily from the corpus until they make `count` new tokens
    (or the corpus runs out); ties go to the smallest pair, so the result is deterministic."""
    splitter = pre_tokenizers.ByteLevel(add_prefix_space=False)
    words = Counter(piece for piece, _ in splitter.pre_tokenize_str(_CORPUS))
    spelled = {word: list(word) for word in words}
    merges: list[tuple[str, str]] = []
    made: set[str] = set()
    while len(made) < count:
        pairs: Counter[tuple[str, str]] = Counter()
        for word, parts in spelled.items():
            for pair in zip(parts, parts[1:]):
                pairs[pair] += words[word]
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merges.append(best)
        made.add(best[0] + best[1])
        for word, parts in spelled.items():
            merged: list[str] = []
            i = 0
            while i < len(parts):
                if i + 1 < len(parts) and (parts[i], parts[i + 1]) == best:
                    merged.append(parts[i] + parts[i + 1])
                    i += 2
                else:
                    merged.append(parts[i])
                    i += 1
            spelled[word] = merged
    return merges


def write_tiny_tokenizer(directory: str | Path, vocab_size: int = 320, *, add_bos: bool = False) -> Path:
    """Write `tokenizer.json` and `tokenizer_config.json` for a byte-level BPE of exactly
    `vocab_size` ids into `directory` (created if missing) and return it.

    Ids: 0 `<|endoftext|>` (BOS), 1 `<|im_start|>`, 2 `<|im_end|>` (EOS), 3..258 the 256 bytes,
    then learned merges; past what the small corpus yields, the rest are reserved special tokens
    `<|reserved_N|>`. `vocab_size` must be at least 259."""
    base = len(TINY_SPECIAL_TOKENS) + 256
    if vocab_size < base:
        raise ValueError(f"vocab_size must be at least {base} (3 special tokens + 256 bytes)")
    merges = _learn_merges(vocab_size - base)
    vocab: dict[str, int] = {token: i for i, token in enumerate(TINY_SPECIAL_TOKENS)}
    table = byte_to_unicode()
    for byte in range(256):
        vocab[table[byte]] = len(vocab)
    for left, right in merges:
        vocab.setdefault(left + right, len(vocab))
    reserved = [f"<|reserved_{n}|>" for n in range(vocab_size - len(vocab))]
    for token in reserved:
        vocab[token] = len(vocab)
    backend = Backend(models.BPE(vocab=vocab, merges=merges, continuing_subword_prefix="", end_of_word_suffix=""))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    specials = [*TINY_SPECIAL_TOKENS, *reserved]
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in specials])
    if backend.get_vocab_size(with_added_tokens=True) != vocab_size:
        raise ValueError(f"tiny tokenizer came out with a vocabulary of {backend.get_vocab_size()} ids")
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    backend.save(str(out / "tokenizer.json"))
    config = {
        "bos_token": TINY_SPECIAL_TOKENS[0],
        "eos_token": TINY_SPECIAL_TOKENS[2],
        "pad_token": TINY_SPECIAL_TOKENS[0],
        "add_bos_token": add_bos,
        "add_eos_token": False,
        "chat_template": CHATML_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    return out
