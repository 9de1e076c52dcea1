"""Message threads for `/v1/messages` (the Anthropic SDK's `thread` parameter, which its tool runner
sends): `{"type": "create"}` keeps the conversation under the reply's id; `{"type": "continue",
"previous_message_id": ID}` sends only the new turn, after what is kept under ID.

Owns `ThreadStore`: an LRU of at most `max_entries` `KeptThread`s (the request's messages and the
reply as an assistant message, and the `system` and `tools` a continuing request leaves out, as
the SDK's does), each dropped `ttl_s` seconds after it was stored. It lives in the API
process only: a restart forgets every thread, and an unknown or expired id is a 404 that says so.
The prefix cache, not this store, makes a continued turn fast. It knows nothing of HTTP bodies
beyond the validated messages.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from freetoken.server.anthropic.protocol import AnthropicMessage, TextBlock
from freetoken.server.errors import APIError

DEFAULT_MAX_ENTRIES = 256
DEFAULT_TTL_S = 3600.0


@dataclass(frozen=True)
class KeptThread:
    messages: tuple[AnthropicMessage, ...]
    system: str | list[TextBlock] | None
    tools: list[dict[str, Any]] | None


class ThreadStore:
    def __init__(
        self,
        max_entries: int = DEFAULT_MAX_ENTRIES,
        ttl_s: float = DEFAULT_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self._clock = clock
        self._entries: OrderedDict[str, tuple[float, KeptThread]] = OrderedDict()

    def put(self, message_id: str, thread: KeptThread) -> None:
        self._expire()
        self._entries[message_id] = (self._clock(), thread)
        self._entries.move_to_end(message_id)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def get(self, message_id: str) -> KeptThread:
        """The thread kept under `message_id`; a 404 naming `thread.previous_message_id` when
        there is none (never kept, expired, or evicted)."""
        self._expire()
        found = self._entries.get(message_id)
        if found is None:
            raise APIError(
                404,
                f"no thread is kept under message id {message_id!r} (unknown, expired or evicted); send the whole conversation",
                param="thread.previous_message_id",
                code="not_found",
            )
        self._entries.move_to_end(message_id)
        return found[1]

    def _expire(self) -> None:
        cutoff = self._clock() - self.ttl_s
        for key in [k for k, (at, _) in self._entries.items() if at <= cutoff]:
            del self._entries[key]
