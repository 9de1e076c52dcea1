"""The bounded store of responses kept for `GET /v1/responses/{id}` and `previous_response_id`.

Owns `ResponseStore`: an LRU of at most `max_entries` responses, each dropped `ttl_s` seconds
after it was stored (a read refreshes its LRU place, not its age). It lives in the API process
only: a restart of the server forgets every response, and the engine's prefix cache is what makes
a chained request fast, not this store. `StoredResponse` keeps what a later turn needs to render
the same conversation and splice its exact tokens (see `prompt.py`). The clock is
injected so tests can age entries without sleeping. It knows nothing of HTTP.
"""

from __future__ import annotations

import time
from array import array
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

DEFAULT_MAX_ENTRIES = 1024
DEFAULT_TTL_S = 3600.0


@dataclass(frozen=True)
class StoredResponse:
    """One finished response. `messages` is its conversation as chat messages (without its
    `instructions`, which a later turn does not inherit) followed by its own output;
    `prompt_text` / `prompt_ids` are what the engine was given and `output_ids` what it wrote;
    `plain_output` says the output was one text message (no calls, no reasoning)."""

    body: dict[str, Any]
    messages: tuple[dict[str, Any], ...]
    prompt_text: str
    prompt_ids: array[int]
    output_ids: array[int]
    boundaries: tuple[int, ...]
    plain_output: bool
    input_items: tuple[dict[str, Any], ...] = ()  # this request's `input`, as input_items lists it


class ResponseStore:
    def __init__(
        self,
        max_entries: int = DEFAULT_MAX_ENTRIES,
        ttl_s: float = DEFAULT_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_entries < 0 or ttl_s <= 0:
            raise ValueError(f"a response store needs max_entries >= 0 and ttl_s > 0, got {max_entries}, {ttl_s}")
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self._clock = clock
        self._entries: OrderedDict[str, tuple[float, StoredResponse]] = OrderedDict()

    def __len__(self) -> int:
        self._expire()
        return len(self._entries)

    def put(self, response_id: str, entry: StoredResponse) -> None:
        self._expire()
        if self.max_entries == 0:
            return
        self._entries[response_id] = (self._clock(), entry)
        self._entries.move_to_end(response_id)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        self._expire()
        found = self._entries.get(response_id)
        if found is None:
            return None
        self._entries.move_to_end(response_id)
        return found[1]

    def delete(self, response_id: str) -> bool:
        self._expire()
        return self._entries.pop(response_id, None) is not None

    def _expire(self) -> None:
        """Drop entries older than the TTL (oldest stored first; reads do not renew an entry)."""
        cutoff = self._clock() - self.ttl_s
        for key in [k for k, (at, _) in self._entries.items() if at <= cutoff]:
            del self._entries[key]
