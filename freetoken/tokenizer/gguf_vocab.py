"""Building a Hugging Face `tokenizers.Tokenizer` from a GGUF file's tokenizer metadata.

Owns the translation of llama.cpp's `tokenizer.ggml.*` keys (vocabulary, scores, token types,
merges, pre-tokenizer name) into a `tokenizers` pipeline -- model, normalizer, pre-tokenizer,
decoder and added tokens -- that gives the same ids as transformers 5.x loading the same file (which
matches llama.cpp). It does not add BOS/EOS (the `Tokenizer` wrapper does), does not pick special or
stop ids, and knows nothing of chat templates.

Supported `tokenizer.ggml.model` values:
- "llama": a SentencePiece vocabulary run as BPE with byte fallback; the merges are recovered from
  the vocabulary (ranked by file position where the architecture's family says so,
  `GGUFFacts.vocab_by_position`: Gemma 3's; by score otherwise).
- "gpt2": byte-level BPE with the file's merges.
- "gemma4": Gemma 4's SentencePiece-style BPE (text spaces become U+2581, byte fallback, no space
  prefix) with the file's merges; llama.cpp's converter writes the vocabulary as `tokenizer.json`
  spells it, so no token is respelled.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import numpy as np
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as Backend

from freetoken.errors import ModelLoadError
from freetoken.families import find_gguf
from freetoken.tokenizer.cache import TokenizerCache

# llama.cpp's token types (gguf.TokenType).
TOKEN_NORMAL = 1
TOKEN_UNKNOWN = 2
TOKEN_CONTROL = 3
TOKEN_USER_DEFINED = 4
TOKEN_UNUSED = 5
TOKEN_BYTE = 6

SPIECE_SPACE = "\u2581"

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# `tokenizer.ggml.pre` -> the split regex its merges were learned with. A name not listed here
# (e.g. "default", "gpt2", "smollm") takes GPT-2's own ByteLevel regex.
_BYTE_LEVEL_SPLITS: dict[str, str] = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "dbrx": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
    "gpt-4o": _GPT4O_SPLIT,
    "llama4": _GPT4O_SPLIT,
}


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table used by byte-level BPE vocabularies."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("\xa1"), ord("\xac") + 1))
        + list(range(ord("\xae"), ord("\xff") + 1))
    )
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _list_field(metadata: dict[str, object], key: str) -> list:
    value = metadata.get(key)
    if value is None:
        return []
    if not isinstance(value, list):
        raise ModelLoadError(f"GGUF metadata {key} is not a list")
    return value


def merges_from_vocab(tokens: Sequence[str], priority: Sequence[float]) -> list[tuple[str, str]]:
    """BPE merges implied by a SentencePiece vocabulary: every split of a token into two tokens of
    the vocabulary, best first -- higher `priority` of the merged token, then longer left part,
    then longer right part, then file order."""
    # Ranked as numbers in compact arrays and split into strings only once sorted: Gemma 3's
    # 262k-token vocabulary has ~10^6 merges, and a tuple of both halves per merge while sorting
    # was ~290 MB of load-time peak.
    present = set(tokens)
    orders, cuts = array("l"), array("l")
    for order, token in enumerate(tokens):
        for cut in range(1, len(token)):
            if token[:cut] in present and token[cut:] in present:
                orders.append(order)
                cuts.append(cut)
    order_of = np.frombuffer(orders, dtype=np.int64) if orders else np.zeros(0, np.int64)
    cut_of = np.frombuffer(cuts, dtype=np.int64) if cuts else np.zeros(0, np.int64)
    prio = np.asarray(priority, dtype=np.float64)[order_of]
    length = np.fromiter((len(t) for t in tokens), dtype=np.int64, count=len(tokens))[order_of]
    ranked = np.lexsort((order_of, cut_of - length, -cut_of, -prio))  # the last key sorts first
    return [(tokens[o][:c], tokens[o][c:]) for o, c in zip(order_of[ranked].tolist(), cut_of[ranked].tolist())]


def _spm_backend(metadata: dict[str, object], file_tokens: list[str], cache: TokenizerCache | None) -> Backend:
    tokens = file_tokens
    # a family whose vocabulary is laid out in merge order (families/base.py, `vocab_by_position`)
    facts = find_gguf(str(metadata.get("general.architecture", "")))
    position_ranked = facts is not None and facts.vocab_by_position
    if position_ranked:
        # Runs of spaces are stored as real spaces, but the normalizer turns text spaces into U+2581.
        tokens = [SPIECE_SPACE * len(t) if t and t == " " * len(t) else t for t in tokens]
        priority: Sequence[float] = [-float(i) for i in range(len(tokens))]
    else:
        priority = [float(s) for s in _list_field(metadata, "tokenizer.ggml.scores")]
        if len(priority) != len(tokens):
            raise ModelLoadError("GGUF tokenizer.ggml.scores does not match the vocabulary length")
    vocab = {token: index for index, token in enumerate(tokens)}
    unk_id = metadata.get("tokenizer.ggml.unknown_token_id")
    unk_token = tokens[unk_id] if isinstance(unk_id, int) and 0 <= unk_id < len(tokens) else None
    if cache is None:
        merges = merges_from_vocab(tokens, priority)
    else:
        merges = cache.merges(tokens, priority, vocab, lambda: merges_from_vocab(tokens, priority))
    model = models.BPE(vocab=vocab, merges=merges, unk_token=unk_token, fuse_unk=True, byte_fallback=True, dropout=None)
    backend = Backend(model)
    if position_ranked:
        _gemma_pipeline(backend)
    else:
        decode_steps = [decoders.Replace(SPIECE_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
        add_prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
        backend.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement=SPIECE_SPACE, prepend_scheme="first" if add_prefix else "never", split=False
        )
        if add_prefix:
            decode_steps.append(decoders.Strip(content=" ", left=1, right=0))
        backend.decoder = decoders.Sequence(decode_steps)
    _add_marked_tokens(backend, metadata, file_tokens, vocab, byte_level=False)
    return backend


def _gemma_pipeline(backend: Backend) -> None:
    """Gemma's (transformers' `GemmaTokenizer`): no space prefix, every text space becomes U+2581
    before the model sees it, `<0xHH>` pieces decode to their bytes."""
    backend.normalizer = normalizers.Replace(" ", SPIECE_SPACE)
    backend.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    backend.decoder = decoders.Sequence([decoders.Replace(SPIECE_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])


def _file_merges(metadata: dict[str, object]) -> list[tuple[str, str]]:
    """`tokenizer.ggml.merges` as pairs. Each line is cut at its first space after the first
    character, as llama.cpp reads it (so a left part may itself be a space)."""
    merges: list[tuple[str, str]] = []
    for line in _list_field(metadata, "tokenizer.ggml.merges"):
        text = str(line)
        cut = text.find(" ", 1)
        if cut < 0:
            raise ModelLoadError(f"GGUF merge {line!r} is not two tokens")
        merges.append((text[:cut], text[cut + 1 :]))
    return merges


def _gemma4_backend(metadata: dict[str, object], tokens: list[str]) -> Backend:
    if "tokenizer.ggml.merges" not in metadata:
        raise ModelLoadError("the gemma4 GGUF tokenizer has no tokenizer.ggml.merges")
    vocab = {token: index for index, token in enumerate(tokens)}
    unk_id = metadata.get("tokenizer.ggml.unknown_token_id")
    if isinstance(unk_id, int) and 0 <= unk_id < len(tokens):
        unk_token: str | None = tokens[unk_id]
    else:
        unk_token = "<unk>" if "<unk>" in vocab else None
    model = models.BPE(
        vocab=vocab, merges=_file_merges(metadata), unk_token=unk_token, fuse_unk=True, byte_fallback=True, dropout=None
    )
    backend = Backend(model)
    _gemma_pipeline(backend)
    _add_marked_tokens(backend, metadata, tokens, vocab, byte_level=False)
    return backend


def _gpt2_backend(metadata: dict[str, object], tokens: list[str]) -> Backend:
    table = byte_to_unicode()
    alphabet = set(table.values())
    spelled = [t if set(t) <= alphabet else "".join(table[b] for b in t.encode("utf-8")) for t in tokens]
    vocab = {token: index for index, token in enumerate(spelled)}
    merges: list[tuple[str, str]] = []
    for line in _list_field(metadata, "tokenizer.ggml.merges"):
        parts = str(line).split(" ")
        if len(parts) != 2:
            raise ModelLoadError(f"GGUF merge {line!r} is not two tokens")
        merges.append((parts[0], parts[1]))
    model = models.BPE(
        vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False
    )
    backend = Backend(model)
    split = _BYTE_LEVEL_SPLITS.get(str(metadata.get("tokenizer.ggml.pre", "")))
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    backend.decoder = decoders.ByteLevel()
    _add_marked_tokens(backend, metadata, tokens, vocab, byte_level=True)
    return backend


def _add_marked_tokens(
    backend: Backend, metadata: dict[str, object], tokens: list[str], vocab: dict[str, int], *, byte_level: bool
) -> None:
    """CONTROL tokens become special added tokens, USER_DEFINED ones plain added tokens, so that
    both are matched whole in the text (as llama.cpp does) instead of being cut into pieces.

    `tokens` is the file's spelling and `vocab` the model's; a user-defined token the model spells
    differently (Gemma's runs of spaces) is left to the model, as transformers does."""
    types = _list_field(metadata, "tokenizer.ggml.token_type")
    if not types:
        return
    alphabet = set(byte_to_unicode().values()) if byte_level else None
    control: list[AddedToken] = []
    user: list[AddedToken] = []
    for token, kind in zip(tokens, types):
        if kind == TOKEN_CONTROL:
            # In a byte-level vocabulary a control token outside the byte alphabet is a mislabel;
            # adding it would grow the vocabulary past the model's.
            if alphabet is None or set(token) <= alphabet:
                control.append(AddedToken(token, normalized=False, special=True))
        elif kind == TOKEN_USER_DEFINED and token in vocab:
            user.append(AddedToken(token, normalized=False, special=False))
    if control:
        backend.add_special_tokens(control)
    if user:
        backend.add_tokens(user)


def backend_from_gguf_metadata(metadata: dict[str, object], cache: TokenizerCache | None = None) -> Backend:
    """A `tokenizers.Tokenizer` for the vocabulary described by GGUF `metadata` (no BOS/EOS
    post-processing). With `cache`, a SentencePiece vocabulary's derived merges are read from it
    when they were derived before, else kept there (cache.py)."""
    kind = metadata.get("tokenizer.ggml.model")
    tokens = [str(t) for t in _list_field(metadata, "tokenizer.ggml.tokens")]
    if kind is None or not tokens:
        raise ModelLoadError("the GGUF file has no tokenizer vocabulary (tokenizer.ggml.tokens)")
    if kind == "llama":
        return _spm_backend(metadata, tokens, cache)
    if kind == "gpt2":
        return _gpt2_backend(metadata, tokens)
    if kind == "gemma4":
        return _gemma4_backend(metadata, tokens)
    raise ModelLoadError(f"unsupported GGUF tokenizer model {kind!r} (supported: 'llama', 'gpt2', 'gemma4')")


def byte_fallback_ids(backend: Backend) -> frozenset[int]:
    """Ids of the `<0xHH>` tokens a byte-fallback decoder turns into raw bytes (empty when the
    decoder has no ByteFallback step)."""
    decoder = backend.decoder
    if decoder is None or b"ByteFallback" not in decoder.__getstate__():
        return frozenset()
    # Every spelling of `<0xHH>` (either case of each hex digit) looked up: 1,024 lookups where
    # listing the vocabulary took ~0.4 s for Gemma 3's 262k tokens.
    ids = set()
    for byte in range(256):
        high, low = f"{byte >> 4:X}", f"{byte & 15:X}"
        for text in {f"<0x{a}{b}>" for a in (high, high.lower()) for b in (low, low.lower())}:
            token_id = backend.token_to_id(text)
            if token_id is not None:
                ids.add(token_id)
    return frozenset(ids)
