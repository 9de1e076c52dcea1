"""The gated delta rule and the short causal convolution of linear-attention layers, in plain torch.

Owns the arithmetic of a Gated DeltaNet token mixer's two recurrences, each reading a state and
returning the new one (the caller stores it):

- `causal_conv1d`: a depthwise causal convolution over one request's chunk, its state the last
  `kernel - 1` inputs before the chunk; `causal_conv1d_step` does one token of many requests.
- the gated delta rule on one head's state S [Dk, Dv]: per token t, S <- exp(g_t) S, then
  S <- S + k_t (beta_t (v_t - S^T k_t))^T, and the output o_t = S^T q_t.
  `chunk_gated_delta_rule` runs a request's prefill chunk in the chunked (WY / UT) form, chunk by
  chunk of `CHUNK` tokens; `recurrent_gated_delta_rule` runs one token of many requests (decode
  rows) in the recurrent form. Both compute in float32, whatever the inputs' dtype.

Decode rows also have an in-place form, `recurrent_gated_delta_` and `causal_conv1d_step_`: they
update the requests' rows of the state pool where they lie. On CPU with the extension built
(csrc/gated_delta.cpp) that is one pass of two over each state and no temporaries; the torch form
gathers the rows, runs the reference above and scatters them back (same math; the sums' order
differs, so results agree to float32 rounding, not bit for bit).

It knows no model: query / key normalisation and scaling, the decay's parametrisation and where
states live are the caller's.
"""

from __future__ import annotations

import logging
from types import ModuleType

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

CHUNK = 64  # tokens per block of the chunked form


def _load() -> ModuleType | None:
    try:
        from freetoken.ops import _gated_delta_cpu  # built by `pip install -e .` (setup.py)
    except ImportError as err:
        log.info("freetoken.ops: C++ gated delta kernel not built (%s); using torch", err)
        return None
    return _gated_delta_cpu


_KERNEL: ModuleType | None = _load()  # decided once at import


def causal_conv1d(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [n, C] (one request's consecutive inputs), state [C, K - 1] (the inputs before them, zero
    at the start), weight [C, K] -> (out [n, C], new state [C, K - 1]), in state's dtype; out[t]
    = sum_j weight[:, j] * input[t - (K - 1) + j]. No activation."""
    k = weight.shape[1]
    full = torch.cat([state, x.to(state.dtype).t()], dim=1)  # [C, K - 1 + n]
    out = F.conv1d(full[None], weight.to(state.dtype)[:, None, :], groups=weight.shape[0])[0]  # [C, n]
    return out.t(), full[:, full.shape[1] - (k - 1) :]


def causal_conv1d_step(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of B requests: x [B, C], state [B, C, K - 1], weight [C, K] -> (out [B, C], new
    state [B, C, K - 1]), in state's dtype."""
    full = torch.cat([state, x.to(state.dtype)[:, :, None]], dim=2)  # [B, C, K]
    out = (full * weight.to(state.dtype)[None]).sum(dim=2)  # [B, C]
    return out, full[:, :, 1:]


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One request's n tokens: q, k [n, H, Dk], v [n, H, Dv], g (log decay, <= 0) and beta [n, H],
    state [H, Dk, Dv] -> (out [n, H, Dv], new state [H, Dk, Dv]), float32.

    Within a block of C tokens with cumulative log decay G (G_i = g_1 + ... + g_i) and the state S0
    before it, the corrections u_i = beta_i (v_i - (decayed state before token i)^T k_i) solve the
    unit lower-triangular system (I + A) U = beta V - (beta exp(G) K) S0, with A_ij = beta_i
    exp(G_i - G_j) k_i . k_j for j < i. Then o_i = exp(G_i) S0^T q_i + sum_{j <= i} exp(G_i - G_j)
    (q_i . k_j) u_j and the state after the block is exp(G_C) S0 + sum_j exp(G_C - G_j) k_j u_j^T."""
    f32 = torch.float32
    q, k, v = (t.to(f32).transpose(0, 1) for t in (q, k, v))  # [H, n, D]
    g, beta = g.to(f32).t(), beta.to(f32).t()  # [H, n]
    s = state.to(f32)
    n = q.shape[1]
    out = torch.empty_like(v)  # [H, n, Dv]
    for a in range(0, n, chunk):
        b = min(a + chunk, n)
        qc, kc, vc, bc = q[:, a:b], k[:, a:b], v[:, a:b], beta[:, a:b, None]  # [H, C, D], beta [H, C, 1]
        G = g[:, a:b].cumsum(dim=1)  # [H, C]
        diff = G[:, :, None] - G[:, None, :]  # [H, C, C]: G_i - G_j
        causal = torch.ones(b - a, b - a, dtype=torch.bool, device=q.device).tril()  # j <= i
        decay = diff.masked_fill(~causal, float("-inf")).exp()  # [H, C, C], 0 above the diagonal
        eG = G.exp()[:, :, None]  # [H, C, 1]
        A = (bc * (kc @ kc.transpose(1, 2)) * decay).tril(-1)  # [H, C, C], strictly lower
        system = A + torch.eye(b - a, dtype=f32, device=q.device)
        rhs = bc * vc - (bc * eG * kc) @ s  # [H, C, Dv]
        u = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)  # [H, C, Dv]
        out[:, a:b] = (eG * qc) @ s + ((qc @ kc.transpose(1, 2)) * decay) @ u
        last = G[:, -1:]  # [H, 1]
        s = last.exp()[:, :, None] * s + (kc * (last - G).exp()[:, :, None]).transpose(1, 2) @ u
    return out.transpose(0, 1), s


def recurrent_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of B requests: q, k [B, H, Dk], v [B, H, Dv], g, beta [B, H], state [B, H, Dk, Dv]
    -> (out [B, H, Dv], new state [B, H, Dk, Dv]), float32."""
    f32 = torch.float32
    q, k, v, g, beta = (t.to(f32) for t in (q, k, v, g, beta))
    s = state.to(f32) * g.exp()[:, :, None, None]  # [B, H, Dk, Dv]
    predicted = (s * k[:, :, :, None]).sum(dim=2)  # [B, H, Dv]: S^T k
    delta = (v - predicted) * beta[:, :, None]  # [B, H, Dv]
    s = s + k[:, :, :, None] * delta[:, :, None, :]
    return (s * q[:, :, :, None]).sum(dim=2), s


def _native(states: torch.Tensor) -> bool:
    return _KERNEL is not None and states.is_cpu and states.dtype == torch.float32 and states.is_contiguous()


def causal_conv1d_step_(
    x: torch.Tensor, states: torch.Tensor, weight: torch.Tensor, slots: torch.Tensor
) -> torch.Tensor:
    """`causal_conv1d_step` on the pool's rows: x [B, C], states [S, C, K - 1], weight [C, K],
    slots int64 [B] (distinct) -> out [B, C] in states' dtype; states[slots] advanced in place."""
    if _native(states):
        return _KERNEL.causal_conv1d_step_(x.float().contiguous(), states, weight.float().contiguous(), slots)  # type: ignore[union-attr]
    out, states[slots] = causal_conv1d_step(x, states[slots], weight)
    return out


def recurrent_gated_delta_(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """`recurrent_gated_delta_rule` on the pool's rows: q, k [B, Hk, Dk] (key heads: value head h
    reads key head h / (Hv / Hk)), v [B, Hv, Dv], g, beta [B, Hv], states [S, Hv, Dk, Dv], slots
    int64 [B] (distinct) -> out [B, Hv, Dv] float32; states[slots] advanced in place."""
    if _native(states):
        f32 = [t.float().contiguous() for t in (q, k, v, g, beta)]
        return _KERNEL.recurrent_gated_delta_(*f32, states, slots)  # type: ignore[union-attr]
    per_key = v.shape[1] // q.shape[1]
    if per_key != 1:
        q, k = q.repeat_interleave(per_key, dim=1), k.repeat_interleave(per_key, dim=1)  # [B, Hv, Dk]
    out, states[slots] = recurrent_gated_delta_rule(q, k, v, g, beta, states[slots])
    return out
