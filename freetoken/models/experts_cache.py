"""The expert cache of `--moe-strategy offload`: the decoded, kernel-ready form of the experts
used last, within a byte budget shared by all layers, evicted least recently used first.

Owns the LRU order, the byte accounting and the counters (`hits`, `misses`, `evictions`, bytes
held and bytes decoded into the cache), and giving evicted entries' memory back to the OS;
`resize` moves its budget at run time (the elastic memory of `engine.resize`). It does not know what an expert is: `get` is handed a key and a function that
builds the entry on a miss (models/experts.py decodes the expert from its backing store).
"""

from __future__ import annotations

import ctypes
import ctypes.util
from collections import OrderedDict
from collections.abc import Callable, Hashable

GIB = 1 << 30
# Bytes evicted between two returns of freed memory to the OS (see _trim; ~0.1 s each): the
# cache's capacity, within these bounds.
TRIM_BYTES = (16 << 20, 64 << 20)


def _load_malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # not glibc
        return None


# An evicted expert is freed when its entry is dropped (no reference cycle holds a PackedWeight),
# but glibc keeps the freed heap pages until malloc_trim: without it the RSS of benchmarks/moe.py
# (a 54 MB cache) grew ~20 MB per decode step.
_MALLOC_TRIM = _load_malloc_trim()


class ExpertCache:
    """Entries by key, each with its size in bytes; the bytes held stay within `capacity_bytes`
    after every `get`, except for the one entry just built when it alone is larger."""

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"expert cache capacity must be >= 0 bytes, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._entries: OrderedDict[Hashable, tuple[object, int]] = OrderedDict()
        self.bytes = 0  # held now
        self.hits = self.misses = self.evictions = 0
        self.loaded_bytes = 0  # decoded into the cache since start (misses x their sizes)
        self._evicted_since_trim = 0

    def get(self, key: Hashable, build: Callable[[], tuple[object, int]]) -> object:
        """The entry for `key`: from the cache (a hit, now most recent) or `build()`'s (a miss),
        inserted and older entries evicted to fit."""
        found = self._entries.get(key)
        if found is not None:
            self.hits += 1
            self._entries.move_to_end(key)
            return found[0]
        self.misses += 1
        value, size = build()
        self.loaded_bytes += size
        self._entries[key] = (value, size)
        self.bytes += size
        self._evict_to(self.capacity_bytes, keep=key)
        return value

    def resize(self, capacity_bytes: int) -> int:
        """Set the budget; evicts down to it now. Returns the bytes freed."""
        if capacity_bytes < 0:
            raise ValueError(f"expert cache capacity must be >= 0 bytes, got {capacity_bytes}")
        before = self.bytes
        self.capacity_bytes = capacity_bytes
        self._evict_to(capacity_bytes, keep=None)
        return before - self.bytes

    def _evict_to(self, limit: int, keep: Hashable | None) -> None:
        while self.bytes > limit and self._entries:
            key = next(iter(self._entries))
            if key == keep:
                if len(self._entries) == 1:
                    return  # the entry in use is the only one: it stays until the next miss
                self._entries.move_to_end(key)
                continue
            size = self._entries.pop(key)[1]  # the entry is not kept: freed here, trimmed later
            self.bytes -= size
            self.evictions += 1
            self._evicted_since_trim += size
        if self._evicted_since_trim >= min(max(self.capacity_bytes, TRIM_BYTES[0]), TRIM_BYTES[1]):
            self._trim()

    def _trim(self) -> None:
        """Hand the evicted entries' freed heap memory back to the OS (glibc)."""
        self._evicted_since_trim = 0
        if _MALLOC_TRIM is not None:
            _MALLOC_TRIM(0)

    def __len__(self) -> int:
        return len(self._entries)

    def status(self) -> dict[str, int | float]:
        lookups = self.hits + self.misses
        return {
            "capacity_bytes": self.capacity_bytes,
            "bytes": self.bytes,
            "entries": len(self._entries),
            "hits": self.hits,
            "misses": self.misses,
            "evictions": self.evictions,
            "loaded_bytes": self.loaded_bytes,
            "hit_rate": self.hits / lookups if lookups else 0.0,
        }
