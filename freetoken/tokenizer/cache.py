"""The tokenizer cache on disk: a SentencePiece vocabulary's merges, derived once, read on later starts.

A GGUF file carries a SentencePiece vocabulary without its merges; gguf_vocab.py derives them
from the tokens and their scores, which takes ~1.9 s for Gemma 3's 262,144 tokens (~515k merges)
on a 2-core Zen 3 — on every start, in the API process and wherever else a tokenizer is built.
This module keeps them: `tokenizers/<digest>.merges` under the weight cache's directory
(`--weights-cache`; `off` turns this off too), each merge as the ids of its two tokens (4 MB for
Gemma 3; read back as pairs of the vocabulary's own strings in ~0.1 s, no new strings made). An
entry is keyed by a digest of the tokens and priorities the merges are derived from (content, not
the file's path or date) and of the code that derives them; its first line is that key and an
XXH3-128 digest of the rest. An entry whose key or digest does not match, whose size is not a
whole number of pairs or whose ids fall outside the vocabulary is a miss (deleted, logged) and
the caller derives the merges again. Writes go to a temporary file renamed into place; the
`KEEP` most recently used entries are kept.

It does not derive merges or build tokenizers (gguf_vocab.py).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np
import xxhash

from freetoken.utils.disk_cache import cache_dir, code_identity

log = logging.getLogger("freetoken.tokenizer")

KEEP = 8  # entries kept (one per vocabulary; Gemma 3's is 4 MB)
STALE_TMP_S = 3600  # a temporary file older than this is a crashed write's


def vocabulary_digest(tokens: Sequence[str], priority: Sequence[float]) -> str:
    """XXH3-128 of the tokens (their lengths, then their text) and their priorities; ~40 ms for
    262k tokens."""
    h = xxhash.xxh3_128()
    h.update(np.fromiter(map(len, tokens), dtype=np.int64, count=len(tokens)).tobytes())
    h.update("".join(tokens).encode("utf-8", "surrogatepass"))
    h.update(np.asarray(priority, dtype=np.float64).tobytes())
    return h.hexdigest()


@functools.cache
def _code() -> str:
    package = Path(__file__).resolve().parents[1]
    return code_identity([package / "tokenizer"])


class TokenizerCache:
    """Derived merges in `directory`, by the digest of their vocabulary."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    @staticmethod
    def for_setting(weights_cache: str | None) -> TokenizerCache | None:
        """The cache `--weights-cache` implies (its `tokenizers/` subdirectory), or None (`off`)."""
        root = cache_dir(weights_cache)
        return None if root is None else TokenizerCache(root / "tokenizers")

    def merges(
        self,
        tokens: Sequence[str],
        priority: Sequence[float],
        vocab: Mapping[str, int],
        derive: Callable[[], list[tuple[str, str]]],
    ) -> list[tuple[str, str]]:
        """The merges `derive` makes of `tokens` ranked by `priority` (`vocab`: token -> its id in
        `tokens`): read from the cache, or derived and written."""
        key = {"vocabulary": vocabulary_digest(tokens, priority), "code": _code()}
        path = self.directory / f"{xxhash.xxh3_128_hexdigest(json.dumps(key, sort_keys=True).encode())}.merges"
        pairs = self._read(path, key, len(tokens))
        if pairs is not None:  # the vocabulary's own strings, gathered in C (2x a comprehension over ids)
            strings = np.array(tokens, dtype=object)
            return list(zip(strings[pairs[:, 0]].tolist(), strings[pairs[:, 1]].tolist()))
        merges = derive()
        ids = np.fromiter((vocab[t] for pair in merges for t in pair), dtype="<i4", count=2 * len(merges))
        self._write(path, key, ids.tobytes())
        return merges

    def _read(self, path: Path, key: dict, vocab_size: int) -> np.ndarray | None:
        try:
            with path.open("rb") as f:
                head = json.loads(f.readline())
                body = f.read()
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as err:
            return self._unusable(path, str(err))
        if not isinstance(head, dict) or head.get("key") != key:
            return self._unusable(path, "its first line names another key")
        if head.get("xxh3_128") != xxhash.xxh3_128_hexdigest(body):
            return self._unusable(path, "its digest does not match")
        if len(body) % 8:
            return self._unusable(path, f"{len(body)} bytes is not a whole number of pairs")
        pairs = np.frombuffer(body, dtype="<i4").reshape(-1, 2)
        if pairs.size and not (0 <= int(pairs.min()) and int(pairs.max()) < vocab_size):
            return self._unusable(path, "an id lies outside the vocabulary")
        try:
            os.utime(path)  # recently used: kept by the next write's pruning
        except OSError:
            pass
        return pairs

    def _unusable(self, path: Path, why: str) -> None:
        log.warning("tokenizer cache entry %s is unusable (%s): deleted, deriving the merges again", path.name, why)
        try:
            path.unlink(missing_ok=True)
        except OSError:
            pass  # a read-only cache: the entry stays, and is checked (and refused) again

    def _write(self, path: Path, key: dict, body: bytes) -> None:
        head = json.dumps({"key": key, "xxh3_128": xxhash.xxh3_128_hexdigest(body)}).encode() + b"\n"
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            tmp.write_bytes(head + body)
            os.replace(tmp, path)
            self._prune()
        except OSError as err:
            log.warning("tokenizer cache: could not write %s (%s)", path, err)
            tmp.unlink(missing_ok=True)

    def _prune(self) -> None:
        """Keep the `KEEP` most recently used entries; drop crashed writes' temporary files."""
        now = time.time()
        entries = []
        for p in self.directory.iterdir():
            try:
                entries.append((p.stat().st_mtime, p))
            except OSError:
                continue
        entries.sort(reverse=True)
        kept = 0
        for mtime, p in entries:
            if p.suffix == ".merges" and kept < KEEP:
                kept += 1
            elif p.suffix == ".merges" or (p.suffix == ".tmp" and now - mtime > STALE_TMP_S):
                p.unlink(missing_ok=True)
