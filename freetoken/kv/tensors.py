"""The physical K/V memory: one key and one value tensor per layer, in pages.

Owns allocating the tensors of the two pools (FULL for full-attention layers, SWA for
sliding-window layers) and writing / gathering them by slot or page. A layer's tensors are
`[num_pages + 1, page_size, n_kv_heads, head_dim]` where page 0 is the NULL sentinel: zero-filled
and never written. A linear-attention layer (Gated DeltaNet, Qwen3.5) has no pages: it has, per
state slot, a conv state `[slots + 1, conv_dim, kernel - 1]` and a recurrent state
`[slots + 1, v_heads, k_dim, v_dim]`, both float32 and zero-filled, slot 0 the NULL sentinel (the
KV manager's state pool owns the slots). It does not decide which page belongs to whom (that is the KV core's page
pool and manager) and it does not compute attention.

The cache dtype (`--kv-cache-dtype`): `auto` stores K/V in the model's dtype, `bf16` in
bfloat16, `int8` (CPU and CUDA; `q8_0` is accepted as its name) and `fp8_e4m3` (CUDA) in 8 bits
with one float16 scale per block of 32 values of each (slot, head), as GGML's q8_0: quantized on
write (scale = max |x| over the block / qmax), dequantized by attention as it gathers rows
(attention/kv_read.py). The scale tensor `[pages + 1, P, n_kv, D / 32]` is attached to each
layer's tensor as `.kv_scale`; page 0's scales stay zero, so NULL reads as zero either way.
Scales per slot, not per page: a page is written a token at a time during decode, so a page
scale would have to rescale rows already written whenever a larger value arrives; blocks of 32
rather than one scale per head: on Gemma 3 270M one scale per head lost greedy agreement within
two tokens on 2 of 6 prompts (docs/kv-cache.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from freetoken.config import KV_CACHE_DTYPES
from freetoken.errors import ConfigError
from freetoken.ops.attention import write_kv
from freetoken.utils.zeroed import zeros

_QMAX = {torch.int8: 127.0}
if hasattr(torch, "float8_e4m3fn"):
    _QMAX[torch.float8_e4m3fn] = 448.0
BLOCK = 32  # values per scale along head_dim (q8_0's block); the whole head when D is not a multiple
SCALE_DTYPE = torch.float16
SCALE_BYTES = 2


def scale_blocks(head_dim: int) -> int:
    """Scales per (slot, head): one per BLOCK values of head_dim."""
    return head_dim // BLOCK if head_dim % BLOCK == 0 else 1


def storage_dtype(cache_dtype: str, model_dtype: torch.dtype, device: torch.device | str) -> torch.dtype:
    """The dtype K/V are stored in for `--kv-cache-dtype`; ConfigError naming the flag."""
    if cache_dtype not in KV_CACHE_DTYPES:
        raise ConfigError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {cache_dtype!r}")
    if cache_dtype == "auto":
        return model_dtype
    if cache_dtype == "bf16":
        return torch.bfloat16
    if cache_dtype in ("int8", "q8_0"):
        return torch.int8
    if torch.device(device).type != "cuda" or not hasattr(torch, "float8_e4m3fn"):
        raise ConfigError("--kv-cache-dtype fp8_e4m3 needs a CUDA device; use int8 on CPU")
    return torch.float8_e4m3fn


@dataclass(frozen=True)
class KVLayout:
    """What the K/V memory needs to know of a model: which layers slide, and the head shape.
    (The model config builds it: `ModelConfig.kv_layout()`; kv never imports models.)"""

    sliding: tuple[bool, ...]  # per layer: True = sliding-window layer (SWA pool)
    num_kv_heads: int
    head_dim: int
    swa_num_kv_heads: int | None = None  # the sliding layers' head shape where it differs (Gemma 4)
    swa_head_dim: int | None = None
    linear: tuple[bool, ...] = ()  # per layer: True = linear-attention layer (a state slot, no pages)
    conv_shape: tuple[int, int] = (0, 0)  # a linear layer's conv state: (conv_dim, kernel - 1)
    recurrent_shape: tuple[int, int, int] = (0, 0, 0)  # and its recurrent state: (v_heads, k_dim, v_dim)

    @property
    def has_state(self) -> bool:
        """True for a hybrid model: some layers keep a per-request state instead of pages."""
        return any(self.linear)

    def is_linear(self, layer: int) -> bool:
        return bool(self.linear) and self.linear[layer]

    def state_bytes(self) -> int:
        """Bytes one state slot takes over every linear layer (float32)."""
        c, k = self.conv_shape
        h, dk, dv = self.recurrent_shape
        return 4 * sum(self.linear) * (c * k + h * dk * dv)

    @property
    def has_swa(self) -> bool:
        return any(self.sliding)

    def head_shape(self, sliding: bool) -> tuple[int, int]:
        """(n_kv_heads, head_dim) of the layers of one pool."""
        if sliding:
            return self.swa_num_kv_heads or self.num_kv_heads, self.swa_head_dim or self.head_dim
        return self.num_kv_heads, self.head_dim


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
        cache_dtype: str = "auto",
        state_slots: int = 0,
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
        self.device = torch.device(device)
        self.dtype = storage_dtype(cache_dtype, dtype, self.device)  # what the pages hold
        self.quantized = self.dtype in _QMAX
        self.sliding = config.sliding
        if config.has_state and state_slots < 1:
            raise ValueError(f"a model with linear-attention layers needs state slots, got {state_slots}")
        self.state_slots = state_slots if config.has_state else 0
        self.linear = tuple(config.is_linear(i) for i in range(len(self.sliding)))
        self.k: list[torch.Tensor] = []  # per layer: [pages + 1, P, n_kv_heads, head_dim] (empty: linear layer)
        self.v: list[torch.Tensor] = []
        self.conv: list[torch.Tensor | None] = []  # per layer: [slots + 1, conv_dim, kernel - 1] (None: attention)
        self.recurrent: list[torch.Tensor | None] = []  # per layer: [slots + 1, v_heads, k_dim, v_dim]
        for sliding, linear in zip(self.sliding, self.linear):
            if linear:
                self.k.append(torch.zeros(0, device=self.device))
                self.v.append(torch.zeros(0, device=self.device))
                n = self.state_slots + 1
                self.conv.append(zeros((n, *config.conv_shape), torch.float32, self.device))
                self.recurrent.append(zeros((n, *config.recurrent_shape), torch.float32, self.device))
                continue
            pages = self.num_swa_pages if sliding else self.num_full_pages
            shape = (pages + 1, page_size, *config.head_shape(sliding))
            self.k.append(self._zeros(shape))
            self.v.append(self._zeros(shape))
            self.conv.append(None)
            self.recurrent.append(None)

    @property
    def nbytes(self) -> int:
        """Bytes of every pool tensor (K and V of every layer, with an 8-bit cache's scales)."""
        tensors = [*self.k, *self.v]
        scales = [t.kv_scale for t in tensors if hasattr(t, "kv_scale")]
        states = [t for t in (*self.conv, *self.recurrent) if t is not None]
        return sum(t.numel() * t.element_size() for t in [*tensors, *scales, *states])

    def copy_state(self, src: int, dst: int) -> None:
        """Copy the conv and recurrent states of slot `src` into slot `dst` in every linear layer
        (a prefix-cache snapshot taken or a hit's copy; the KV manager decides which slots)."""
        if not 0 < src <= self.state_slots or not 0 < dst <= self.state_slots or src == dst:
            raise ValueError(f"state copy from slot {src} to {dst} of {self.state_slots}")
        for t in (*self.conv, *self.recurrent):
            if t is not None:
                t[dst].copy_(t[src])

    def _state_parts(self, slot: int) -> list[torch.Tensor]:
        return [t[slot] for t in (*self.conv, *self.recurrent) if t is not None]

    def state_nbytes(self) -> int:
        """Bytes `state_bytes` gives for one slot (0: the model has no linear layers)."""
        return _nbytes(self._state_parts(0))

    def state_bytes(self, slot: int) -> torch.Tensor:
        """A host copy of one state slot of every linear layer, as one uint8 tensor (the disk
        tier's payload of a snapshot): each layer's conv state, then each one's recurrent state."""
        return _packed(self._state_parts(slot))

    def load_state(self, slot: int, payload: memoryview | bytes) -> None:
        """Write a payload of `state_bytes` into one state slot (a disk load into a request's slot)."""
        if not 0 < slot <= self.state_slots:
            raise ValueError(f"state slot {slot} of {self.state_slots}")
        _unpack(self._state_parts(slot), payload, "state")

    def clear_states(self, slots: list[int]) -> None:
        """Zero the conv and recurrent states of `slots` in every linear layer (a fresh request)."""
        for t in (*self.conv, *self.recurrent):
            if t is not None:
                t[slots] = 0

    def _zeros(self, shape: tuple[int, ...]) -> torch.Tensor:
        """A zero pool tensor of `shape`, with its zero scales when the cache is 8-bit."""
        t = zeros(shape, self.dtype, self.device)  # pages zeroed as first written: a start does not pay for them
        if self.quantized:
            blocks = scale_blocks(shape[3])
            t.kv_scale = zeros((*shape[:3], blocks), SCALE_DTYPE, self.device)  # type: ignore[attr-defined]
        return t

    def _quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, n_kv, D] -> (stored [T, n_kv, D], scale [T, n_kv, G]), G blocks of D."""
        qmax = _QMAX[self.dtype]
        t, n_kv, d = x.shape
        g = scale_blocks(d)
        xf = x.float().view(t, n_kv, g, d // g)  # [T, n_kv, G, D / G]
        scale = (xf.abs().amax(dim=-1) / qmax).to(SCALE_DTYPE).clamp_min(1e-7)  # [T, n_kv, G], as stored
        q = xf / scale.float().unsqueeze(-1)
        if self.dtype == torch.int8:
            q = q.round_().clamp_(-qmax, qmax)
        return q.to(self.dtype).view(t, n_kv, d), scale

    @staticmethod
    def bytes_per_page(
        config: KVLayout,
        page_size: int,
        dtype: torch.dtype,
        sliding: bool,
        cache_dtype: str = "auto",
        device: torch.device | str = "cpu",
    ) -> int:
        """Bytes one page of the SWA (`sliding`) or FULL pool takes over all layers of its kind
        (`dtype` is the model's; an 8-bit cache adds its scales)."""
        layers = sum(1 for i, s in enumerate(config.sliding) if s == sliding and not config.is_linear(i))
        stored = storage_dtype(cache_dtype, dtype, device)
        element = torch.empty((), dtype=stored).element_size()
        heads, head_dim = config.head_shape(sliding)
        per_head = head_dim * element + (SCALE_BYTES * scale_blocks(head_dim) if stored in _QMAX else 0)
        return 2 * layers * page_size * heads * per_head

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the K/V of T tokens: slots [T] int64 (>= page_size), k and v [T, n_kv_heads, head_dim]."""
        if not self.quantized and write_kv(self.k[layer], self.v[layer], slots, k, v):
            return  # both pools in one C++ call (a float cache of k's dtype on CPU)
        for pool, x in ((self.k[layer], k), (self.v[layer], v)):
            flat = pool.view(-1, *pool.shape[2:])  # [(pages + 1) * P, n_kv, D]
            if self.quantized:
                stored, scale = self._quantize(x)
                flat.index_copy_(0, slots, stored)
                pool.kv_scale.view(-1, *pool.kv_scale.shape[2:]).index_copy_(0, slots, scale)  # type: ignore[attr-defined]
            else:
                flat.index_copy_(0, slots, x.to(self.dtype))

    def gather(self, layer: int, pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the pages `pages` [B, C] -> each [B, C * P, n_kv_heads, head_dim]."""
        b, c = pages.shape
        idx = pages.long()
        k = self._read(self.k[layer], idx)  # [B, C, P, n_kv, D]
        v = self._read(self.v[layer], idx)  # [B, C, P, n_kv, D]
        return k.view(b, c * self.page_size, *k.shape[3:]), v.view(b, c * self.page_size, *v.shape[3:])

    def _read(self, pool: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """pool[idx], dequantized to float32 when the cache is 8-bit."""
        if not self.quantized:
            return pool[idx]
        return dequantize(pool[idx], pool.kv_scale[idx], torch.float32)  # type: ignore[attr-defined]

    def resize(self, sliding: bool, pages: int) -> None:
        """Give every layer of one pool (SWA when `sliding`) `pages` pages: pages 1..min(old,
        new) keep their K/V, new pages are zero. Run between steps only (a run-time resize)."""
        if pages < 1:
            raise ValueError(f"a pool needs at least one page, got {pages}")
        for i, s in enumerate(self.sliding):
            if s != sliding or self.linear[i]:
                continue
            for kv in (self.k, self.v):
                old = kv[i]
                new = self._zeros((pages + 1, *old.shape[1:]))  # the old memory is freed with `old`
                keep = min(pages + 1, old.shape[0])
                new[:keep] = old[:keep]
                if self.quantized:
                    new.kv_scale[:keep] = old.kv_scale[:keep]  # type: ignore[attr-defined]
                kv[i] = new
        if sliding:
            self.num_swa_pages = pages
        else:
            self.num_full_pages = pages

    def resize_states(self, slots: int) -> None:
        """Give every linear layer `slots` state slots: slots 1..min(old, new) keep their states,
        new ones are zero. Run between steps only (a run-time resize of the state pool)."""
        if not self.state_slots:
            raise ValueError("this model has no linear-attention layers, so no state slots")
        if slots < 1:
            raise ValueError(f"a state pool needs at least one slot, got {slots}")
        for states in (self.conv, self.recurrent):
            for i, old in enumerate(states):
                if old is None:
                    continue
                new = torch.zeros((slots + 1, *old.shape[1:]), dtype=old.dtype, device=old.device)
                keep = min(slots + 1, old.shape[0])
                new[:keep] = old[:keep]
                states[i] = new  # the old memory is freed with `old`
        self.state_slots = slots

    def _page_parts(self, sliding: bool, page: int) -> list[torch.Tensor]:
        """Views of one page of every layer of a pool: K, V (and their scales) per layer, in order."""
        parts: list[torch.Tensor] = []
        for i, s in enumerate(self.sliding):
            if s != sliding or self.linear[i]:
                continue
            for t in (self.k[i], self.v[i]):
                parts.append(t[page])
                if self.quantized:
                    parts.append(t.kv_scale[page])  # type: ignore[attr-defined]
        return parts

    def page_nbytes(self, sliding: bool) -> int:
        """Bytes `page_bytes` gives for one page of the SWA (`sliding`) or FULL pool."""
        return _nbytes(self._page_parts(sliding, 0))

    def page_bytes(self, sliding: bool, page: int) -> torch.Tensor:
        """A host copy of one page of every layer of a pool, as one uint8 tensor (the disk tier's
        payload): each layer's K then V, with an 8-bit cache's scales after each."""
        return _packed(self._page_parts(sliding, page))

    def load_page(self, sliding: bool, page: int, payload: memoryview | bytes) -> None:
        """Write a payload of `page_bytes` into one page of every layer of a pool (a disk load)."""
        if page < 1:
            raise ValueError("page 0 is the NULL page and is never written")
        _unpack(self._page_parts(sliding, page), payload, "page")

    def null_pages_are_zero(self) -> bool:
        """True while page 0 of every layer is still all zeros (a check for tests and audits)."""
        pools = [t for i, t in enumerate((*self.k, *self.v)) if not self.linear[i % len(self.linear)]]
        states = [t for t in (*self.conv, *self.recurrent) if t is not None]
        return all(bool((t[0] == 0).all()) for t in (*pools, *states))


def dequantize(stored: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """8-bit K/V as stored [..., D] with its scales [..., G] (one per block of D / G values) ->
    values [..., D] in `dtype`: value = stored * scale."""
    g, d = scale.shape[-1], stored.shape[-1]
    out = stored.to(dtype).view(*stored.shape[:-1], g, d // g) * scale.to(dtype).unsqueeze(-1)
    return out.view(stored.shape)


def _nbytes(parts: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in parts)


def _packed(parts: list[torch.Tensor]) -> torch.Tensor:
    """The views `parts`, in order, as one host uint8 tensor (a disk tier payload)."""
    return torch.cat([t.contiguous().view(-1).view(torch.uint8) for t in parts]).cpu()


def _unpack(parts: list[torch.Tensor], payload: memoryview | bytes, what: str) -> None:
    """Write a `_packed` payload back into the views `parts`; ValueError when its size differs."""
    data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    if data.numel() != _nbytes(parts):
        raise ValueError(f"a {what} payload of {data.numel()} bytes, expected {_nbytes(parts)}")
    at = 0
    for dst in parts:
        n = dst.numel() * dst.element_size()
        dst.copy_(data[at : at + n].view(dst.dtype).view(dst.shape))
        at += n
