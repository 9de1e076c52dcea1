"""Carrying each step's batch from rank 0 to the other ranks: a torch.distributed broadcast.

Owns the wire form of one step: a fixed int64 header `[kind, requests, tokens, logit rows,
table entries]`, then (for a step) one int64 payload `[token ids | (start, n, FULL length, SWA
length or -1) per request | FULL tables | SWA tables | logit rows]`. Rank 0 sends what its
runner is about to run; the others rebuild exactly that `ForwardBatch` from it. The same
communicator then carries the forward's all-reduces, so every rank meets the collectives in one
order and no second channel can fall out of step. It reads no page accounting.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from freetoken.attention.metadata import RequestSpec

STOP, STEP, POOLS = 0, 1, 2
HEADER_LEN = 5


@dataclass(frozen=True)
class Step:
    """One forward's inputs as rank 0's runner built them."""

    ids: list[int]
    specs: list[RequestSpec]
    logit_rows: list[int]


def _broadcast(values: np.ndarray, device: torch.device) -> None:
    dist.broadcast(torch.from_numpy(np.ascontiguousarray(values, dtype=np.int64)).to(device), src=0)


def _receive(n: int, device: torch.device) -> np.ndarray:
    t = torch.empty(n, dtype=torch.int64, device=device)
    dist.broadcast(t, src=0)
    return t.cpu().numpy()


class StepSender:
    """Rank 0's end: every step, the pool sizes once, and the stop."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def send_pools(self, full_pages: int, swa_pages: int, page_size: int) -> None:
        _broadcast(np.array([POOLS, full_pages, swa_pages, page_size, 0]), self.device)

    def send(self, ids: Sequence[int], specs: Sequence[RequestSpec], logit_rows: Sequence[int]) -> None:
        fulls = [np.asarray(s[2], dtype=np.int64) for s in specs]
        swas = [np.asarray(s[3], dtype=np.int64) for s in specs if s[3] is not None]
        meta = [(s[0], s[1], len(f), -1 if s[3] is None else len(s[3])) for s, f in zip(specs, fulls)]
        entries = sum(len(f) for f in fulls) + sum(len(s) for s in swas)
        _broadcast(np.array([STEP, len(specs), len(ids), len(logit_rows), entries]), self.device)
        payload = np.concatenate(
            [
                np.asarray(ids, dtype=np.int64),
                np.asarray(meta, dtype=np.int64).reshape(-1),
                *fulls,
                *swas,
                np.asarray(logit_rows, dtype=np.int64),
            ]
        )
        _broadcast(payload, self.device)

    def stop(self) -> None:
        _broadcast(np.array([STOP, 0, 0, 0, 0]), self.device)


def receive_pools(device: torch.device) -> tuple[int, int, int]:
    """(FULL pages, SWA pages, page size), which rank 0 sends once its pools are sized."""
    kind, full, swa, page_size, _ = (int(v) for v in _receive(HEADER_LEN, device))
    if kind != POOLS:
        raise RuntimeError(f"expected the pool sizes from rank 0, got message kind {kind}")
    return full, swa, page_size


def receive_step(device: torch.device) -> Step | None:
    """The next step from rank 0, or None when rank 0 stops."""
    kind, requests, tokens, rows, entries = (int(v) for v in _receive(HEADER_LEN, device))
    if kind == STOP:
        return None
    if kind != STEP:
        raise RuntimeError(f"expected a step from rank 0, got message kind {kind}")
    payload = _receive(tokens + 4 * requests + entries + rows, device)
    ids = payload[:tokens].tolist()
    meta = payload[tokens : tokens + 4 * requests].reshape(requests, 4)  # [B, (start, n, full len, swa len)]
    at = tokens + 4 * requests
    fulls = []
    for length in meta[:, 2]:
        fulls.append(payload[at : at + length].astype(np.int32))
        at += int(length)
    specs: list[RequestSpec] = []
    for (start, n, _, swa_len), full in zip(meta.tolist(), fulls):
        swa = None
        if swa_len >= 0:
            swa = payload[at : at + swa_len].astype(np.int32)
            at += swa_len
        specs.append((start, n, full, swa))
    return Step(ids, specs, payload[at : at + rows].tolist())
