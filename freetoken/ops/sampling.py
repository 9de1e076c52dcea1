"""The sampler's whole-row passes as one op: temperature applied in place, each row's maximum,
the log of its softmax normaliser and the maxima of its blocks of logits; and a temperature-only
draw's softmax weights in place with their block sums. The C++ code of csrc/sampling.cpp on CPU
for float32 rows; torch's ops elsewhere (other devices, no extension). Also the kernel's deep cut
of a flat row (`deep_cut`), which has no torch form here: None tells the sampler to take its own.

Owns the choice. Both paths divide by the temperature (IEEE division, as `div_`), so the scaled
logits and every maximum are the same bit for bit; the normaliser differs by float32 summation
order and the kernel's exp (~1e-6 relative), which the sampler's top-p cut tolerates. No request or
vocabulary knowledge here.
"""

from __future__ import annotations

import logging
from types import ModuleType

import torch

log = logging.getLogger(__name__)


def _load() -> ModuleType | None:
    try:
        from freetoken.ops import _sampling_cpu  # built by `pip install -e .` (setup.py)
    except ImportError as err:
        log.info("freetoken.ops: C++ sampler passes not built (%s); using torch", err)
        return None
    return _sampling_cpu


_KERNEL: ModuleType | None = _load()  # decided once at import


def row_stats_(
    x: torch.Tensor, temps: torch.Tensor | None, mass: torch.Tensor, block: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """x [R, V] float32, divided in place by `temps` [R] when given. Returns each row's maximum [R]
    (float32), log sum exp(x - max) [R] (float64; 0 for rows where `mass` [R] bool is False) and the
    maxima of its blocks of `block` logits [R, V / block] (None when `block` does not divide V)."""
    if (
        _KERNEL is not None
        and x.device.type == "cpu"
        and x.dtype == torch.float32
        and x.is_contiguous()
        and x.dim() == 2
    ):
        row_max, log_mass, block_max = _KERNEL.row_stats_(
            x, temps.float().contiguous() if temps is not None else None, mass.contiguous(), block
        )
        return row_max, log_mass, block_max if block_max.shape[1] else None
    if temps is not None:
        x.div_(temps.to(x.dtype)[:, None])
    row_max = x.amax(dim=-1)  # [R]
    log_mass = torch.zeros(x.shape[0], dtype=torch.float64, device=x.device)
    rows = mass.nonzero()[:, 0]
    if len(rows):
        log_mass[rows] = (x[rows] - row_max[rows, None]).exp_().sum(dim=-1).double().log()  # float32 cascade sum
    vocab = x.shape[1]
    block_max = x.reshape(x.shape[0], vocab // block, block).amax(dim=-1) if block > 0 and vocab % block == 0 else None
    return row_max, log_mass, block_max


def exp_block_sums_(x: torch.Tensor, row_max: torch.Tensor, block: int) -> torch.Tensor:
    """x [R, V] float32 becomes exp(x - row_max[:, None]) in place; returns the sum of each row's
    blocks of `block` values [R, ceil(V / block)] float32 (the last block may be short). The kernel's
    exp is within ~1 ulp of torch's (and 0 below x - max = -87, where torch's goes on in denormals
    to -103: weights under 1e-38 of the top one) and its float32 sums run in another order: a draw
    that falls on a block boundary may move by one token, the distribution does not."""
    if (
        _KERNEL is not None
        and x.device.type == "cpu"
        and x.dtype == torch.float32
        and x.is_contiguous()
        and x.dim() == 2
    ):
        return _KERNEL.exp_block_sums_(x, row_max.float(), block)
    x.sub_(row_max[:, None]).exp_()
    n, vocab = x.shape
    blocks = -(-vocab // block)
    padded = torch.nn.functional.pad(x, (0, blocks * block - vocab)) if vocab % block else x
    return padded.reshape(n, blocks, block).sum(dim=-1)


def deep_cut(
    row: torch.Tensor, row_max: float, log_mass: float, top_k: int, top_p: float, min_p: float
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The kept ids (ascending) [m] long and renormalised probabilities [m] float64 of one row
    [V] float32 under top-p (1: off; mass relative to the whole row: exp(x - row_max - log_mass))
    and min-p (0: off), as the full-sort filter keeps them (ties by ascending id), in three passes
    over the row and a sort of one bucket of it (csrc/sampling.cpp). None where the kernel does not
    run (no extension, another device or dtype) or declines the row (a NaN in it, a non-finite max
    or normaliser, top_k < V): the sampler's torch path decides those."""
    if (
        _KERNEL is None
        or row.device.type != "cpu"
        or row.dtype != torch.float32
        or row.dim() != 1
        or not row.is_contiguous()
    ):
        return None
    ids, probs = _KERNEL.deep_cut(row, row_max, log_mass, top_k, top_p, min_p)
    return (ids, probs) if len(ids) else None
