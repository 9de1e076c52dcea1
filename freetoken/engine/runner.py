"""Runs the model on one scheduled batch: page tables in, logits out.

Owns the model, the physical K/V tensors and the translation of scheduled items into request
specs and logit rows — one forward over the whole batch, never a Python loop over requests; the
batch itself is built and run by `models/forward.py`. It does not decide which rows give logits
or read the KV manager: each item comes sealed by the scheduler with its logit rows and page
tables, and no page changes owner here. Under tensor parallelism (rank 0 only) it first broadcasts
the step to the other ranks, which run the same `build_batch` and `run_model` on it. On CUDA a
decode step may instead replay a captured graph (`graphs`, engine/cuda_graphs.py), which falls
back to this eager forward for any step it does not serve.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from freetoken.distributed.launch import Peers
from freetoken.engine.cuda_graphs import DecodeGraphs
from freetoken.engine.scheduler import ScheduledItem
from freetoken.kv.tensors import KVTensors
from freetoken.models.config import ModelConfig
from freetoken.models.forward import build_batch, run_model


class Runner:
    def __init__(
        self,
        model: torch.nn.Module,
        config: ModelConfig,
        kv_tensors: KVTensors,
        peers: Peers | None = None,
        alone_max: int = 1,
        graphs: DecodeGraphs | None = None,
    ) -> None:
        self.model = model
        self.config = config
        self.kv_tensors = kv_tensors
        self.device = kv_tensors.device
        self.peers = peers  # the other tensor-parallel ranks (None: this process is the whole model)
        self.alone_max = alone_max  # chunks attended query by query (EngineConfig.alone_max)
        self.graphs = graphs  # captured decode steps (CUDA); None: every step eager

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @torch.inference_mode()
    def forward(self, items: Sequence[ScheduledItem]) -> torch.Tensor:
        """Logits [N, vocab] (float32): for each item in order, the last `item.logit_rows` rows
        of its chunk (ScheduledItem.seal decided them)."""
        ids: list[int] = []
        specs = []
        logit_rows: list[int] = []
        slots: list[int] = []
        end = 0
        for item in items:
            if item.draft:  # a verified chunk: the last token, then the drafted ones
                ids.extend(item.req.token_slice(item.start, item.start + 1))
                ids.extend(item.draft)
            else:
                ids.extend(item.req.token_slice(item.start, item.start + item.n))
            full, swa = item.tables
            specs.append((item.start, item.n, full, swa))
            slots.append(item.state_slot)
            end += item.n
            logit_rows.extend(range(end - item.logit_rows, end))
        state_slots = slots if self.config.has_linear else None
        if self.graphs is not None and self.peers is None:
            out = self.graphs.run(ids, specs, logit_rows)
            if out is not None:
                return out.float().cpu()
        batch = build_batch(self.config, self.kv_tensors, specs, logit_rows, self.alone_max, state_slots)
        if self.peers is None:
            return run_model(self.model, self.kv_tensors, ids, batch).float().cpu()
        self.peers.sender.send(ids, specs, logit_rows)  # only a batch that builds is sent
        try:
            return run_model(self.model, self.kv_tensors, ids, batch).float().cpu()
        except Exception as err:  # noqa: BLE001 - the ranks may be out of step: none can go on
            self.peers.abandon(err)

    @property
    def resizable(self) -> bool:
        """Whether the pools may be resized at run time (not yet across tensor-parallel ranks)."""
        return self.peers is None

    def resize_kv(self, kind: str, pages: int) -> None:
        """Reallocate the tensors of pool `kind` to `pages` pages ("full" / "swa": K/V; "state":
        a hybrid model's state slots)."""
        if kind == "state":
            self.kv_tensors.resize_states(pages)
        else:
            self.kv_tensors.resize(kind == "swa", pages)
        if self.graphs is not None:
            self.graphs.reset()  # the captured graphs read the old tensors
