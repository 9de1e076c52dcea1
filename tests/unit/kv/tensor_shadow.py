"""The content oracle over real K/V tensors: the shadow's page contents live in a `KVTensors`.

`Shadow` (shadow.py) keeps, per page slot, the id of the token prefix its K/V came from in a
dict. `TensorShadow` keeps it in the engine's own K/V memory instead: a real `KVTensors` (one
FULL layer, one sliding layer when the model has a window; 1 KV head of 32 values) in the cache
dtype under test, float32 or int8. Each write stores the prefix id as K = [127, d0, d1, d2, d3,
0, ...] (d_i its base-100 digits) and V = -K through `KVTensors.write` (the int8 path quantizes
it: one block of 32 values whose largest magnitude is 127 has scale 1.0 exactly, so the code
round-trips exactly); every check reads it back through `take_pages`, the read attention uses
(dequantizing with the stored scales). `resize` is `KVTensors.resize`. So the shadow check after
every KV call and at every forward holds for the bytes in memory: a resize that loses a page,
a row or an int8 scale makes a holder's page read as another prefix (or as garbage) and fails.
"""

from __future__ import annotations

import numpy as np
import torch

from freetoken.attention.kv_read import take_pages
from freetoken.kv.tensors import KVLayout, KVTensors
from shadow import Shadow

HEAD_DIM = 32  # one int8 scale block
MARK = 127.0  # the largest value of each row: its int8 scale is 1.0 exactly
DIGITS = 4  # base-100 digits of a prefix id (ids below 10^8)
CORRUPT = -1  # a slot whose bytes are neither zero nor a valid code


def encode(ids: list[int]) -> torch.Tensor:
    """Prefix ids -> K rows [T, 1, HEAD_DIM]."""
    k = torch.zeros(len(ids), 1, HEAD_DIM)
    k[:, 0, 0] = MARK
    for i, pid in enumerate(ids):
        assert 0 < pid < 100**DIGITS, pid
        for d in range(DIGITS):
            k[i, 0, 1 + d] = (pid // 100**d) % 100
    return k


def decode(k: torch.Tensor, v: torch.Tensor) -> np.ndarray:
    """K, V [..., 1, HEAD_DIM] (read back) -> prefix ids [...]: 0 for a zero slot (never
    written, or zeroed), CORRUPT for anything that is not a valid code with V = -K."""
    k, v = k[..., 0, :].double(), v[..., 0, :].double()
    digits = k[..., 1 : 1 + DIGITS].round()
    ids = (digits * torch.tensor([100.0**d for d in range(DIGITS)], dtype=torch.float64)).sum(-1)
    valid = (k[..., 0] == MARK) & (v == -k).all(-1) & (k == k.round()).all(-1)
    valid &= (k[..., 1 + DIGITS :] == 0).all(-1) & (digits >= 0).all(-1) & (digits < 100).all(-1)
    zero = (k == 0).all(-1) & (v == 0).all(-1)
    out = torch.where(valid, ids, torch.full_like(ids, float(CORRUPT)))
    return torch.where(zero, torch.zeros_like(ids), out).long().numpy()


class TensorShadow(Shadow):
    """`Shadow` whose page contents are the bytes of a real `KVTensors` (`cache_dtype`: the
    `--kv-cache-dtype` under test)."""

    def __init__(self, page_size: int, window: int | None, full_pages: int, swa_pages: int | None,
                 cache_dtype: str = "auto") -> None:
        super().__init__(page_size, window)
        sliding = (False, True) if window is not None else (False,)
        layout = KVLayout(sliding=sliding, num_kv_heads=1, head_dim=HEAD_DIM)
        self.tensors = KVTensors(layout, full_pages, swa_pages or 0, page_size, torch.float32, "cpu", cache_dtype)
        self.layer = {"full": 0, "swa": 1}
        self._decoded: dict[str, np.ndarray | None] = {"full": None, "swa": None}
        self.resizes = 0

    def _store(self, kind: str, stores: list[tuple[int, int, int]]) -> None:
        p = self.page_size
        slots = torch.tensor([page * p + slot for page, slot, _ in stores], dtype=torch.long)
        k = encode([pid for _, _, pid in stores])
        self.tensors.write(self.layer[kind], slots, k, -k)
        self._decoded[kind] = None

    def _decode(self, kind: str) -> np.ndarray:
        decoded = self._decoded[kind]
        if decoded is None:
            layer = self.layer[kind]
            pages = torch.arange(self.tensors.k[layer].shape[0])[None, :]  # [1, pages + 1]
            k = take_pages(self.tensors.k[layer], pages, torch.float32)[0]  # [pages + 1, P, 1, D]
            v = take_pages(self.tensors.v[layer], pages, torch.float32)[0]
            decoded = self._decoded[kind] = decode(k, v)  # [pages + 1, P]
        return decoded

    def _slots(self, kind: str, page: int) -> list[int | None]:
        decoded = self._decode(kind)
        if page >= decoded.shape[0]:
            return [CORRUPT] * self.page_size  # past the memory: never a prefix's K/V
        return [int(x) if x else None for x in decoded[page]]

    def resize(self, kind: str, pages: int) -> None:
        """The engine's tensor resize of one pool (`Runner.resize_kv`)."""
        self.tensors.resize(kind == "swa", pages)
        self._decoded[kind] = None
        self.resizes += 1

    def null_page_is_zero(self) -> bool:
        return self.tensors.null_pages_are_zero() and all(
            not self._decode(kind)[0].any() for kind in ("full", "swa") if kind != "swa" or self.window is not None)
