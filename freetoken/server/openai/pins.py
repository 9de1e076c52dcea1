"""`prompt_cache_key` on the OpenAI routes: a retention pin (kv/pins.py) on the system prompt.

Owns `openai_pin_marks`: with a `prompt_cache_key`, the end of a leading system (or developer)
message is marked, for `prompt_cache_retention` `"24h"` 86400 s, else 300 s; the recipe places the
mark at that message's boundary (core/pins.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from freetoken.server.core.pins import PinMarks

OPENAI_TTL_S = {None: 300.0, "in_memory": 300.0, "24h": 86400.0}


def openai_pin_marks(messages: Sequence[dict[str, Any]], key: str | None, retention: str | None) -> PinMarks:
    """`prompt_cache_key`: a mark at the end of a leading system / developer message."""
    if key is None or not messages or messages[0].get("role") not in ("system", "developer"):
        return PinMarks()
    return PinMarks({1: OPENAI_TTL_S.get(retention, 300.0)}, len(messages))
