"""`prompt_cache_key` on the OpenAI routes: a retention pin (kv/pins.py) on the system prompt.

Owns `openai_pins`: with a `prompt_cache_key`, the end of a leading system (or developer) message
is pinned, for `prompt_cache_retention` `"24h"` 86400 s, else 300 s (core/pins.py places it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from freetoken.server.core.pins import Pins, at_boundaries

OPENAI_TTL_S = {None: 300.0, "in_memory": 300.0, "24h": 86400.0}


def openai_pins(messages: Sequence[dict[str, Any]], boundaries: Sequence[int], key: str | None, retention: str | None) -> Pins:
    """`prompt_cache_key`: a pin at the end of a leading system / developer message."""
    if key is None or not messages or messages[0].get("role") not in ("system", "developer"):
        return ()
    return at_boundaries({1: OPENAI_TTL_S.get(retention, 300.0)}, boundaries, len(messages))
