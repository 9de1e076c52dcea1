"""Where an Anthropic request's retention pins go (kv/pins.py): its `cache_control` breakpoints.

Owns `anthropic_pin_marks`: a breakpoint marks the prefix up to the end of the chat message that
holds the marked block (a block of `system` or a marked tool definition: the end of the system
message; the top-level `cache_control`, Anthropic's automatic caching: the end of the last
message); the recipe places the marks at the message boundaries (core/pins.py). TTLs: `"5m"` (the default) 300 s, `"1h"`
3600 s; another `ttl` is a 400 naming the key.
"""

from __future__ import annotations

from typing import Any

from freetoken.server.anthropic.protocol import CacheControl, Conversation, convert_message
from freetoken.server.errors import bad_request
from freetoken.server.core.pins import PinMarks

ANTHROPIC_TTL_S = {None: 300.0, "5m": 300.0, "1h": 3600.0}


def _ttl(control: CacheControl, where: str) -> float:
    if control.ttl not in ANTHROPIC_TTL_S:
        raise bad_request(
            f"{where}.cache_control.ttl must be '5m' or '1h', got {control.ttl!r}", param=f"{where}.cache_control.ttl"
        )
    return ANTHROPIC_TTL_S[control.ttl]


def _blocks(content: Any) -> list[Any]:
    return content if isinstance(content, list) else []


def anthropic_pin_marks(req: Conversation) -> PinMarks:
    """The request's `cache_control` breakpoints, as marks on its chat messages."""
    marks: dict[int, float] = {}  # chat-message count up to the breakpoint -> TTL
    has_system = bool(req.system)
    count = 1 if has_system else 0
    if has_system and not isinstance(req.system, str):
        for i, block in enumerate(req.system or []):
            if block.cache_control is not None:
                marks[1] = max(marks.get(1, 0.0), _ttl(block.cache_control, f"system[{i}]"))
    for i, tool in enumerate(req.tools or []):
        control = tool.get("cache_control") if isinstance(tool, dict) else None
        if isinstance(control, dict) and has_system:
            marks[1] = max(marks.get(1, 0.0), _ttl(CacheControl.model_validate(control), f"tools[{i}]"))
    for i, message in enumerate(req.messages):
        count += len(convert_message(message, f"messages[{i}]"))
        for j, block in enumerate(_blocks(message.content)):
            control = getattr(block, "cache_control", None)
            if control is not None:
                marks[count] = max(marks.get(count, 0.0), _ttl(control, f"messages[{i}].content[{j}]"))
    if req.cache_control is not None:
        marks[count] = max(marks.get(count, 0.0), _ttl(req.cache_control, "request"))
    return PinMarks(marks, count)
