"""What one forward step runs: the flattened tokens of several requests and their page tables.

Owns `ForwardBatch`, a dataclass of explicit tensors (no global forward context), and building it
from per-request page tables. Page-table format (adopted by the KV core): per request an int32
array of page ids; logical page i covers the request's tokens [i*P, (i+1)*P); 0 is the NULL page.
A request's SWA table is as long as its FULL table; entries whose tokens are all out of the window
may be NULL. This module does not allocate or free pages and does not run attention.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

# (first position of the new tokens, number of new tokens, FULL table, SWA table or None)
RequestSpec = tuple[int, int, np.ndarray, "np.ndarray | None"]


@dataclass(frozen=True)
class ForwardBatch:
    """One step over B requests, T tokens in all (request b's tokens are rows
    query_start[b]:query_start[b+1], at consecutive positions ending at kv_lens[b] - 1)."""

    page_size: int
    positions: torch.Tensor  # [T] int64, absolute position of each token in its request
    query_start: torch.Tensor  # [B + 1] int64, cumulative new-token counts
    kv_lens: torch.Tensor  # [B] int64, tokens with K/V after this step (cached + new)
    full_table: torch.Tensor  # [B, max_pages] int32, NULL-padded
    swa_table: torch.Tensor | None  # [B, max_pages] int32, or None without SWA layers
    full_slots: torch.Tensor  # [T] int64, FULL-pool slot each token's K/V is written to
    swa_slots: torch.Tensor | None  # [T] int64, SWA-pool slot, or None
    logits_indices: torch.Tensor  # [N] int64, rows of T that produce logits
    token_request: torch.Tensor  # [T] int64, request index b of each token
    token_offset: torch.Tensor  # [T] int64, index of each token among its request's new tokens
    max_query_len: int  # max new tokens of one request
    sliding_window: int | None  # W the SWA columns below were computed for
    swa_first_page: torch.Tensor | None  # [B] int64, first table column a sliding query can see
    swa_num_pages: int  # table columns to gather per request for sliding layers
    # A request's chunk of at most this many new tokens is attended query by query with the
    # decode kernel's arithmetic, so each of its rows is computed exactly as a decode row would
    # be (1: decode rows only; the engine: a verified chunk's length, or every chunk under
    # --deterministic).
    alone_max: int = 1
    # Hybrid models (linear-attention layers): request b's state slot in the KV tensors' conv and
    # recurrent states (kv/tensors.py); None for a model without such layers. A request whose first
    # new token this step is at position 0 starts from a zero state (the model clears the slot).
    state_slots: torch.Tensor | None = None  # [B] int64
    # Values an attention backend derives from this batch alone (gather slots, masks), built by
    # the first layer that needs them and reused by the others; owned by the backends.
    memo: dict[object, object] = field(default_factory=dict, compare=False, repr=False)

    @property
    def num_requests(self) -> int:
        return int(self.kv_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

    @staticmethod
    def build(
        requests: Sequence[RequestSpec],
        page_size: int,
        all_logits: bool | Sequence[bool] = False,
        device: torch.device | str = "cpu",
        sliding_window: int | None = None,
        logits_indices: Sequence[int] | None = None,
        alone_max: int = 1,
        state_slots: Sequence[int] | None = None,
    ) -> ForwardBatch:
        """Form a batch from `(positions_start, num_new_tokens, full_table, swa_table)` per request.

        `all_logits` (one flag, or one per request) asks for logits at every new token instead
        of only the last (prompt logprobs). `sliding_window` lets sliding layers gather only the
        table columns that can hold in-window keys; without it they gather every column.
        `logits_indices`, when given, names the rows of T that produce logits (possibly none)
        and overrides `all_logits`. `alone_max`: chunks of at most this many tokens are attended
        query by query (the field's comment). `state_slots`: one state slot per request (hybrid
        models), each >= 1 and distinct.
        Raises ValueError when a table is too short or maps a new token to the NULL page.
        """
        if not requests:
            raise ValueError("a batch needs at least one request")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        P = page_size
        flags = [all_logits] * len(requests) if isinstance(all_logits, bool) else list(all_logits)
        if len(flags) != len(requests):
            raise ValueError(f"{len(flags)} all_logits flags for {len(requests)} requests")
        has_swa = requests[0][3] is not None
        if any((r[3] is not None) != has_swa for r in requests):
            raise ValueError("either every request of a batch has an SWA table or none has")

        starts = np.array([int(r[0]) for r in requests], dtype=np.int64)
        counts = np.array([int(r[1]) for r in requests], dtype=np.int64)
        if (starts < 0).any() or (counts < 1).any():
            raise ValueError("each request needs a start >= 0 and at least one new token")
        kv_lens = starts + counts
        pages_needed = (kv_lens + P - 1) // P
        max_pages = int(pages_needed.max())
        query_start = np.concatenate([[0], np.cumsum(counts)])
        token_request = np.repeat(np.arange(len(requests)), counts)
        token_offset = np.arange(int(counts.sum())) - query_start[token_request]
        positions = starts[token_request] + token_offset

        def table(b: int, raw: np.ndarray, name: str) -> np.ndarray:
            raw = np.asarray(raw, dtype=np.int32).reshape(-1)
            if raw.shape[0] < pages_needed[b]:
                raise ValueError(
                    f"request {b}: {name} table has {raw.shape[0]} pages, {pages_needed[b]} needed"
                    f" for {kv_lens[b]} tokens"
                )
            row = np.zeros(max_pages, dtype=np.int32)
            row[: pages_needed[b]] = raw[: pages_needed[b]]
            return row

        def slots(tables: np.ndarray, name: str) -> np.ndarray:
            pages = tables[token_request, positions // P].astype(np.int64)
            if (pages == 0).any():
                t = int(np.flatnonzero(pages == 0)[0])
                raise ValueError(
                    f"request {token_request[t]}: position {positions[t]} maps to the NULL page of its {name} table"
                )
            return pages * P + positions % P

        full = np.stack([table(b, r[2], "FULL") for b, r in enumerate(requests)])
        full_slots = slots(full, "FULL")
        swa = swa_slots = first_page = None
        swa_num_pages = max_pages
        if has_swa:
            swa = np.stack([table(b, r[3], "SWA") for b, r in enumerate(requests)])  # type: ignore[arg-type]
            swa_slots = slots(swa, "SWA")
            if sliding_window is not None:
                # The earliest key any new token of request b sees is starts[b] - W + 1.
                first_page = np.maximum(starts - sliding_window + 1, 0) // P
                swa_num_pages = int((pages_needed - first_page).max())
            else:
                first_page = np.zeros(len(requests), dtype=np.int64)

        if logits_indices is not None:
            rows = np.asarray(logits_indices, dtype=np.int64).reshape(-1)
            if ((rows < 0) | (rows >= len(positions))).any():
                raise ValueError(f"logits_indices must lie in [0, {len(positions)})")
        elif not any(flags):  # the usual step: each request's last token
            rows = query_start[1:] - 1
        else:
            rows = np.concatenate(
                [
                    np.arange(query_start[b], query_start[b + 1]) if flag else np.array([query_start[b + 1] - 1])
                    for b, flag in enumerate(flags)
                ]
            )

        slots_arr = None
        if state_slots is not None:
            slots_arr = np.asarray(state_slots, dtype=np.int64).reshape(-1)
            if slots_arr.shape[0] != len(requests) or (slots_arr < 1).any():
                raise ValueError(f"state_slots must name one slot >= 1 per request, got {list(slots_arr)}")
            if len(set(slots_arr.tolist())) != len(slots_arr):
                raise ValueError(f"two requests of a batch share a state slot: {list(slots_arr)}")

        on_cpu = torch.device(device).type == "cpu"  # then the numpy arrays' tensors are the batch's (no .to per field)

        def t64(a: np.ndarray) -> torch.Tensor:
            t = torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64))
            return t if on_cpu else t.to(device)

        def t32(a: np.ndarray) -> torch.Tensor:
            t = torch.from_numpy(np.ascontiguousarray(a, dtype=np.int32))
            return t if on_cpu else t.to(device)

        return ForwardBatch(
            page_size=P,
            positions=t64(positions),
            query_start=t64(query_start),
            kv_lens=t64(kv_lens),
            full_table=t32(full),
            swa_table=None if swa is None else t32(swa),
            full_slots=t64(full_slots),
            swa_slots=None if swa_slots is None else t64(swa_slots),
            logits_indices=t64(rows),
            token_request=t64(token_request),
            token_offset=t64(token_offset),
            max_query_len=int(counts.max()),
            sliding_window=sliding_window if has_swa else None,
            swa_first_page=None if first_page is None else t64(first_page),
            swa_num_pages=swa_num_pages,
            alone_max=alone_max,
            state_slots=None if slots_arr is None else t64(slots_arr),
        )
