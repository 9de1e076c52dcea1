"""One request's page tables: the request's own references.

Owns the data of a request's KV holding: its FULL and SWA page tables (entry i covers tokens
[i*P, (i+1)*P); 0 = NULL, no reference) and the positions that say which SWA entries must be
live, and (hybrid models) its state slot. Every non-NULL entry is exactly one reference the
request holds. It does no pool
operation itself; the manager changes an entry only together with the matching incref/decref.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestTables:
    """Page tables of one admitted request."""

    rid: str
    full: list[int] = field(default_factory=list)
    swa: list[int] | None = None  # same length as full; None for a model without SWA layers
    next_pos: int = 0  # first position still to be queried (entries before its window are NULL)
    cached_len: int = 0  # tokens the admission hit let it skip
    state: int = 0  # its slot of the state pool (hybrid models), 0 = none held
    committed: tuple[int, ...] = ()  # the tokens of its last commit (page-aligned)
    stops: tuple[int, ...] = ()  # hybrid models: positions where a prompt chunk ends for a snapshot
    rolling: tuple[int, int] = (0, 0)  # its last snapshot at no planned point: (position, slot)
    serial: int = 0  # hybrid models: names the request in the tree's record of ends (never reused)
    cap: int = 0  # hybrid models: its resend cap, floor_to_page(prompt length - 1): one of its ends
    # Speculative decoding (engine/speculative.py): the tables were grown for a verified chunk
    # not yet resolved by `KVManager.accept`; `drafted` stays set once the request has drafted.
    draft_pending: bool = False
    drafted: bool = False

    def held(self, kind: str) -> list[int]:
        """The non-NULL entries of one table (each is one reference); "state": its state slot."""
        if kind == "state":
            return [self.state] if self.state else []
        table = self.full if kind == "full" else (self.swa or [])
        return [p for p in table if p]
