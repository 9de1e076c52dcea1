"""Where FreeToken's caches on disk live, and what identifies the code that wrote an entry.

Owns `--weights-cache`'s directory (`auto`: `$FREETOKEN_CACHE_DIR/weights`, else
`$XDG_CACHE_HOME/freetoken/weights`, else `~/.cache/freetoken/weights`; `off`: none; or a path)
and the digest of a package's code that keys entries, so that an entry made by other code is
never read. It imports no torch: the API process uses it (the tokenizer cache) as the engine
process does (the weight cache). What an entry holds and how it is checked is each cache's own.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from pathlib import Path


def cache_dir(setting: str | None) -> Path | None:
    """The directory `--weights-cache` names: `auto` (the user cache dir), `off` / None (no
    cache), or a path."""
    if setting is None or setting == "off":
        return None
    if setting != "auto":
        return Path(setting).expanduser()
    base = os.environ.get("FREETOKEN_CACHE_DIR")
    if base:
        return Path(base).expanduser() / "weights"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "freetoken" / "weights"


def code_identity(roots: Iterable[Path]) -> str:
    """A digest of every Python and extension file under `roots`: code that packs weights
    differently is another identity (a snapshot from another version is never read)."""
    h = hashlib.sha256()
    for root in roots:
        for p in sorted(root.rglob("*")):
            if p.suffix in (".py", ".so") and p.is_file():
                h.update(str(p.relative_to(root.parent)).encode())
                h.update(p.read_bytes())
    return h.hexdigest()[:32]
