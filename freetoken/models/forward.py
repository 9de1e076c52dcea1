"""One forward of a model over a paged batch: request specs and token ids in, logits out.

Owns the translation of a step's requests (`RequestSpec`: start, length and page tables) into
the `ForwardBatch` the attention reads, and the call into the model. The engine's runner (rank 0,
from its scheduled items) and every tensor-parallel follower (from the step rank 0 broadcasts)
both go through here, so all ranks build the same batch the same way. It picks no pages and
changes no page's ownership: the tables are given.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from freetoken.attention.metadata import ForwardBatch, RequestSpec
from freetoken.kv.tensors import KVTensors
from freetoken.models.config import ModelConfig


def build_batch(
    config: ModelConfig,
    kv_tensors: KVTensors,
    specs: Sequence[RequestSpec],
    logit_rows: Sequence[int],
    alone_max: int = 1,
    state_slots: Sequence[int] | None = None,
) -> ForwardBatch:
    """The ForwardBatch of the requests `specs` (raises ValueError on a malformed table);
    chunks of at most `alone_max` tokens are attended query by query (`ForwardBatch.alone_max`);
    `state_slots`: each request's state slot on a hybrid model."""
    return ForwardBatch.build(
        specs,
        page_size=kv_tensors.page_size,
        logits_indices=logit_rows,
        device=kv_tensors.device,
        sliding_window=config.sliding_window if config.has_swa else None,
        alone_max=alone_max,
        state_slots=state_slots,
    )


def run_model(model: torch.nn.Module, kv_tensors: KVTensors, ids: Sequence[int], batch: ForwardBatch) -> torch.Tensor:
    """input ids -> logits [N, vocab] in the model's compute dtype, for `batch.logits_indices`."""
    input_ids = torch.tensor(ids, dtype=torch.long, device=kv_tensors.device)
    return model(input_ids, batch, kv_tensors)
