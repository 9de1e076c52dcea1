"""Retention pins (kv/pins.py) at message boundaries: the part every protocol's pins share.

A pin is `(prompt position, TTL seconds)`. A protocol says which chat messages its request marks
(Anthropic's `cache_control` breakpoints: anthropic/pins.py; OpenAI's `prompt_cache_key`:
openai/pins.py) as `{message count up to the mark: TTL}`; `at_boundaries` turns those marks into
positions with the message boundaries `render_chat` found, so the SWA window before each stays
live; `PinMarks` carries a request's marks from its protocol to the recipe, which places them
once the prompt is rendered. When the template's boundaries do not line up one per message (a template that rewrites a
prefix), no pin is placed: the request is served, the prefix cache works as always.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

Pins = tuple[tuple[int, float], ...]


def at_boundaries(marks: dict[int, float], boundaries: Sequence[int], num_messages: int) -> Pins:
    """`marks` (message count -> TTL) as pins at those messages' ends."""
    if not marks or len(boundaries) != num_messages:
        return ()
    return tuple((boundaries[k - 1], ttl) for k, ttl in sorted(marks.items()) if 1 <= k <= num_messages)


@dataclass(frozen=True)
class PinMarks:
    """A request's marks before rendering: message count up to each mark -> TTL, out of
    `num_messages` chat messages (a protocol counts them its own way; none: no pins)."""

    marks: dict[int, float] = field(default_factory=dict)
    num_messages: int = 0

    def at(self, boundaries: Sequence[int]) -> Pins:
        return at_boundaries(self.marks, boundaries, self.num_messages)
