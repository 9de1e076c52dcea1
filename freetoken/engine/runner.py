"""Runs the model on one scheduled batch: page tables in, logits out.

Owns the model, the physical K/V tensors and the translation of scheduled items into one
`ForwardBatch` — one forward over the whole batch, never a Python loop over requests. It reads
page tables from the KV manager and never changes ownership of a page.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from freetoken.attention.metadata import ForwardBatch
from freetoken.engine.scheduler import ScheduledItem
from freetoken.kv.manager import KVManager
from freetoken.kv.tensors import KVTensors
from freetoken.models.config import ModelConfig


class Runner:
    def __init__(self, model: torch.nn.Module, config: ModelConfig, kv_tensors: KVTensors, kv: KVManager) -> None:
        self.model = model
        self.config = config
        self.kv_tensors = kv_tensors
        self.kv = kv
        self.device = kv_tensors.device

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @torch.inference_mode()
    def forward(self, items: Sequence[ScheduledItem]) -> torch.Tensor:
        """Logits [N, vocab] (float32): for each item in order, every row of its chunk when it
        asks for prompt logprobs, else its last row when it samples, else nothing."""
        ids: list[int] = []
        specs = []
        logit_rows: list[int] = []
        offset = 0
        for item in items:
            ids.extend(item.req.token_slice(item.start, item.start + item.n))
            full, swa = self.kv.page_tables(item.req.rid)
            specs.append((item.start, item.n, full, swa))
            if item.all_logits:
                logit_rows.extend(range(offset, offset + item.n))
            elif item.samples:
                logit_rows.append(offset + item.n - 1)
            offset += item.n
        batch = ForwardBatch.build(
            specs,
            page_size=self.kv_tensors.page_size,
            logits_indices=logit_rows,
            device=self.device,
            sliding_window=self.config.sliding_window if self.config.has_swa else None,
        )
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        return self.model(input_ids, batch, self.kv_tensors).float().cpu()
