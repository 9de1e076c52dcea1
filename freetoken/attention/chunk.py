"""Attention of one request's chunk of queries over the keys it can see, the inner call of the
SDPA backend's prefill paths.

In bfloat16 on a CPU, torch's fused SDPA kernel converts to float32 and runs at a fraction of the
speed of oneDNN's bfloat16 GEMMs (no AMX here: ~6 ms for 4 heads x 256 queries x 512 keys x
256 dims at one thread, where the two products take ~1 ms). So this path multiplies in bfloat16
and keeps the scores accurate where softmax needs them: a GEMM's bfloat16 output is rounded to
2^-9 of its magnitude, so the scores are computed as `scale * q k^T - m` with m a rough row
maximum (from a first, cheaper pass): the scores near the maximum, the only ones with weight, are
near zero and keep their precision; a score 8 below it, off by ~0.03, weighs e^-8. The softmax
runs in float32. Its error is within 2x of the fused kernel's on random inputs
(tests/model/test_chunk_attention.py) and 1.2x on Gemma 3's own queries and keys (relative RMS of
the output, 0.0023 vs 0.0019); the logits after a 600-token prompt move about as much as the fused
kernel moves them from float32 (0.007-0.05 vs 0.009-0.02 over four prompts). Chunks shorter than
MIN_QUERIES keep the fused kernel: there the matmuls save little; so do chunks over more than
MAX_KEYS keys, so that the GEMMs see a bounded set of shapes (oneDNN keeps memory per shape: with
free shapes, 300 random chunks grew RSS by ~700 MiB; bucketed, by ~70 MiB at most, then flat).
Float32, other devices and CPUs without a bfloat16 unit (no AVX512-BF16 / AMX: AMD Zen 2 / 3,
where oneDNN's bfloat16 GEMMs are emulated) use SDPA: on a Zen 3 the matmul path took 304 ms for
4 heads x 256 queries x 512 keys x 256 dims where SDPA takes 8 ms (38x; 1,538 against 24 ms at
512 x 1024). It holds no state.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from freetoken.utils.hardware import cpu_has_fast_bf16

# Queries from which a bfloat16 CPU chunk takes the matmul path (below, the fused call is cheap).
MIN_QUERIES = 64
# Whether this CPU multiplies bfloat16 natively (decided once: the CPU does not change).
_FAST_BF16 = cpu_has_fast_bf16()
# The GEMMs see few shapes: oneDNN keeps memory per shape it has seen (~2.4 MiB per new chunk
# shape: free chunk and key lengths grew the engine's RSS without bound). Queries are padded to a
# multiple of QUERY_BUCKET (a chunk here has at most 2 * 256 - 1 rows), keys to one of KEY_BUCKET,
# and chunks over more than MAX_KEYS keys keep SDPA: at most 4 x 4 shapes per head layout.
QUERY_BUCKET = 128
KEY_BUCKET = 256
MAX_KEYS = 1024


def attend_chunk(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [1, H, L, D], k and v [1, n_kv, S, D] (H a multiple of n_kv), visible [1, 1, L, S] bool
    (every row sees at least one key) -> [1, H, L, D] in q's dtype."""
    H, n_kv = q.shape[1], k.shape[1]
    fused = (
        q.dtype != torch.bfloat16
        or q.device.type != "cpu"
        or not _FAST_BF16
        or q.shape[2] < MIN_QUERIES
        or k.shape[2] > MAX_KEYS
    )
    if fused:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=scale, enable_gqa=H > n_kv)
    return _centered(q, k, v, visible, scale)


def _centered(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, scale: float) -> torch.Tensor:
    _, H, L, D = q.shape
    n_kv, S = k.shape[1], k.shape[2]
    g = H // n_kv  # query heads per KV head: head h reads KV head h // g
    Lp, Sp = _bucket(L, QUERY_BUCKET), _bucket(S, KEY_BUCKET)
    qg = F.pad(q, (0, 0, 0, Lp - L)).reshape(n_kv, g * Lp, D)  # [n_kv, g Lp, D]
    kt = F.pad(k[0], (0, 0, 0, Sp - S)).transpose(1, 2)  # [n_kv, D, Sp]
    hidden = F.pad(~visible[0, 0], (0, Sp - S, 0, Lp - L), value=True)  # [Lp, Sp]: padding hidden
    hidden[L:, 0] = False  # a padded query row sees one key: no row is empty
    rough = torch.bmm(qg, kt).view(n_kv, g, Lp, Sp).masked_fill_(hidden, float("-inf"))
    m = rough.amax(dim=-1).mul_(scale).view(n_kv, g * Lp, 1)  # [n_kv, g Lp, 1]: each row's max, to 2^-8
    scores = torch.baddbmm(m, qg, kt, beta=-1, alpha=scale).view(n_kv, g, Lp, Sp)  # scale q k^T - m
    p = torch.softmax(scores.masked_fill_(hidden, float("-inf")), dim=-1, dtype=torch.float32)
    out = torch.bmm(p.to(torch.bfloat16).view(n_kv, g * Lp, Sp), F.pad(v[0], (0, 0, 0, Sp - S)))  # [n_kv, g Lp, D]
    return out.view(n_kv, g, Lp, D)[:, :, :L].reshape(1, H, L, D)


def _bucket(n: int, step: int) -> int:
    return -(-n // step) * step
