"""Which sampling fields a protocol's request leaves out, for the checkpoint's defaults to fill
(`SamplingDefaults`, weights/sampling_defaults.py, read once at start-up)."""

from __future__ import annotations

from freetoken.weights.sampling_defaults import FIELDS


def left_out(request: object) -> frozenset[str]:
    """The sampling fields `request` (a protocol's request model) does not set: None or absent
    (Anthropic's has no `min_p`: the request leaves it out)."""
    return frozenset(name for name in FIELDS if getattr(request, name, None) is None)
