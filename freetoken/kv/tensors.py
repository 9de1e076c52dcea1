"""The physical K/V memory: one key and one value tensor per layer, in pages.

Owns allocating the tensors of the two pools (FULL for full-attention layers, SWA for
sliding-window layers) and writing / gathering them by slot or page. A layer's tensors are
`[num_pages + 1, page_size, n_kv_heads, head_dim]` where page 0 is the NULL sentinel: zero-filled
and never written. It does not decide which page belongs to whom (that is the KV core's page
pool and manager) and it does not compute attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVLayout:
    """What the K/V memory needs to know of a model: which layers slide, and the head shape.
    (The model config builds it: `ModelConfig.kv_layout()`; kv never imports models.)"""

    sliding: tuple[bool, ...]  # per layer: True = sliding-window layer (SWA pool)
    num_kv_heads: int
    head_dim: int

    @property
    def has_swa(self) -> bool:
        return any(self.sliding)


class KVTensors:
    """K/V pages of every layer. Slot `s` of a pool is token `s % P` of page `s // P`."""

    def __init__(
        self,
        config: KVLayout,
        full_pages: int,
        swa_pages: int,
        page_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if full_pages < 1:
            raise ValueError(f"the FULL pool needs at least one page, got {full_pages}")
        if config.has_swa and swa_pages < 1:
            raise ValueError(f"a model with sliding-window layers needs SWA pages, got {swa_pages}")
        self.page_size = page_size
        self.num_full_pages = full_pages
        self.num_swa_pages = swa_pages if config.has_swa else 0
        self.dtype = dtype
        self.device = torch.device(device)
        self.sliding = config.sliding
        self.k: list[torch.Tensor] = []  # per layer: [pages + 1, P, n_kv_heads, head_dim]
        self.v: list[torch.Tensor] = []
        for sliding in self.sliding:
            pages = self.num_swa_pages if sliding else self.num_full_pages
            shape = (pages + 1, page_size, config.num_kv_heads, config.head_dim)
            self.k.append(torch.zeros(shape, dtype=dtype, device=self.device))
            self.v.append(torch.zeros(shape, dtype=dtype, device=self.device))

    @staticmethod
    def bytes_per_page(config: KVLayout, page_size: int, dtype: torch.dtype, sliding: bool) -> int:
        """Bytes one page of the SWA (`sliding`) or FULL pool takes over all layers of its kind."""
        layers = sum(1 for s in config.sliding if s == sliding)
        element = torch.empty((), dtype=dtype).element_size()
        return 2 * layers * page_size * config.num_kv_heads * config.head_dim * element

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the K/V of T tokens: slots [T] int64 (>= page_size), k and v [T, n_kv_heads, head_dim]."""
        k_flat = self.k[layer].view(-1, *self.k[layer].shape[2:])  # [(pages + 1) * P, n_kv, D]
        v_flat = self.v[layer].view(-1, *self.v[layer].shape[2:])  # [(pages + 1) * P, n_kv, D]
        k_flat.index_copy_(0, slots, k.to(self.dtype))
        v_flat.index_copy_(0, slots, v.to(self.dtype))

    def gather(self, layer: int, pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the pages `pages` [B, C] -> each [B, C * P, n_kv_heads, head_dim]."""
        b, c = pages.shape
        idx = pages.long()
        k = self.k[layer][idx]  # [B, C, P, n_kv, D]
        v = self.v[layer][idx]  # [B, C, P, n_kv, D]
        return k.view(b, c * self.page_size, *k.shape[3:]), v.view(b, c * self.page_size, *v.shape[3:])

    def resize(self, sliding: bool, pages: int) -> None:
        """Give every layer of one pool (SWA when `sliding`) `pages` pages: pages 1..min(old,
        new) keep their K/V, new pages are zero. Run between steps only (a run-time resize)."""
        if pages < 1:
            raise ValueError(f"a pool needs at least one page, got {pages}")
        for i, s in enumerate(self.sliding):
            if s != sliding:
                continue
            for kv in (self.k, self.v):
                old = kv[i]
                if pages + 1 <= old.shape[0]:
                    kv[i] = old[: pages + 1].clone()  # a copy, so the old memory is freed
                else:
                    extra = torch.zeros((pages + 1 - old.shape[0], *old.shape[1:]), dtype=old.dtype, device=old.device)
                    kv[i] = torch.cat([old, extra])
        if sliding:
            self.num_swa_pages = pages
        else:
            self.num_full_pages = pages

    def null_pages_are_zero(self) -> bool:
        """True while page 0 of every layer is still all zeros (a check for tests and audits)."""
        return all(bool((t[0] == 0).all()) for t in (*self.k, *self.v))
