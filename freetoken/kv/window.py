"""Page and sliding-window arithmetic shared by the tree, the manager and the audit.

Owns the pure functions that say which pages a window covers, the hit rule of DESIGN.md §3 and
the SWA pool floor (whose formula lives in `freetoken.config`). No state, no pools, no tree: everything here is a function of integers.

Window convention: W counts the keys a query sees including itself, so a query at position q
sees keys k with q - k < W. Page i covers token positions [i*P, (i+1)*P).
"""

from __future__ import annotations

from collections.abc import Sequence

from freetoken.config import swa_floor_pages
from freetoken.errors import ConfigError


def floor_to_page(n: int, page_size: int) -> int:
    """The largest multiple of page_size that is <= n (n >= 0)."""
    return n - n % page_size


def num_pages(num_tokens: int, page_size: int) -> int:
    """Pages needed to hold num_tokens tokens."""
    return -(-num_tokens // page_size)


def first_window_page(end: int, window: int, page_size: int) -> int:
    """Index of the first page overlapping the last W - 1 tokens before position `end`.

    The same number splits a request's SWA table at `next_pos = end`: pages below it hold only
    tokens no query at or after `end` can see (q - k >= W), pages from it on may still be read.
    """
    return max(0, end - window + 1) // page_size


def hit_length(
    path_pages: int,
    swa_live: Sequence[bool] | None,
    prompt_len: int,
    page_size: int,
    window: int | None,
    snapshots: Sequence[bool] | None = None,
) -> int:
    """The hit rule: how many prompt tokens a new request may skip.

    `path_pages` whole pages of the prompt exist in the tree (full entries); `swa_live[i]` says
    whether the SWA entry of page i is live (None for a model without SWA layers). The cap comes
    first: L <= floor_to_page(prompt_len - 1), so at least one token is computed. Then the largest
    L = k*P under the cap whose window (every SWA page overlapping the last W - 1 tokens before L)
    is live. The rule is not monotone in L, so every k is checked, not only the longest path.
    `snapshots[i]` (hybrid models, None otherwise) says whether a recurrent-state snapshot exists
    at the end of page i: then L = k*P also needs `snapshots[k - 1]`.
    """
    if prompt_len <= 1:
        return 0
    max_k = min(path_pages, floor_to_page(prompt_len - 1, page_size) // page_size)
    windowed = swa_live is not None and window is not None
    if not windowed and snapshots is None:
        return max_k * page_size
    best = 0
    last_dead = -1  # index of the last tombstone among pages [0, k)
    for k in range(1, max_k + 1):
        if windowed:
            if not swa_live[k - 1]:  # type: ignore[index]
                last_dead = k - 1
            if last_dead >= first_window_page(k * page_size, window, page_size):  # type: ignore[arg-type]
                continue
        if snapshots is None or snapshots[k - 1]:
            best = k
    return best * page_size


def swa_floor(max_running: int, max_prefill: int, window: int, page_size: int) -> int:
    """Smallest SWA pool that can serve R running requests and one C-token prefill chunk:
    R * (ceil((W - 1) / P) + 1) + ceil(C / P) + 1. One formula for the project: the engine's
    start-up check (`EngineConfig.resolve`) uses the same function."""
    if min(max_running, max_prefill, window, page_size) < 1:
        raise ConfigError("swa_floor needs positive max_running, max_prefill, window, page_size")
    return swa_floor_pages(max_running, max_prefill, window, page_size)
