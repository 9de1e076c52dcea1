"""The gated delta rule and the causal conv1d (ops/gated_delta.py) against transformers' torch
fallbacks (Qwen3.5's `torch_chunk_gated_delta_rule`, `torch_recurrent_gated_delta_rule`), and the
chunked form against the recurrent one token by token, with block and chunk boundaries anywhere;
the decode rows' in-place forms against the reference.
float32 throughout; tolerance 1e-5 (the forms sum in different orders)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

from freetoken.ops import gated_delta
from freetoken.ops.gated_delta import (
    causal_conv1d,
    causal_conv1d_step,
    chunk_gated_delta_rule,
    recurrent_gated_delta_rule,
)

TOL = 1e-5
H, DK, DV = 3, 8, 6


def inputs(n: int, seed: int) -> tuple[torch.Tensor, ...]:
    """q, k l2-normed (q also scaled), v, g <= 0, beta in (0, 1), an initial state."""
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(n, H, DK, generator=gen), dim=-1) * DK**-0.5
    k = F.normalize(torch.randn(n, H, DK, generator=gen), dim=-1)
    v = torch.randn(n, H, DV, generator=gen)
    g = -torch.rand(n, H, generator=gen) * 2
    beta = torch.rand(n, H, generator=gen)
    state = torch.randn(H, DK, DV, generator=gen) * 0.3
    return q, k, v, g, beta, state


def token_by_token(q, k, v, g, beta, state):  # noqa: ANN001, ANN202
    outs = []
    s = state[None]
    for t in range(q.shape[0]):
        o, s = recurrent_gated_delta_rule(q[t : t + 1], k[t : t + 1], v[t : t + 1], g[t : t + 1], beta[t : t + 1], s)
        outs.append(o)
    return torch.cat(outs), s[0]


@pytest.mark.parametrize("n", [1, 5, 64, 130])
@pytest.mark.parametrize("chunk", [4, 64])
def test_chunked_equals_recurrent(n: int, chunk: int) -> None:
    q, k, v, g, beta, state = inputs(n, n)
    got, got_s = chunk_gated_delta_rule(q, k, v, g, beta, state, chunk=chunk)
    want, want_s = token_by_token(q, k, v, g, beta, state)
    torch.testing.assert_close(got, want, atol=TOL, rtol=TOL)
    torch.testing.assert_close(got_s, want_s, atol=TOL, rtol=TOL)


@pytest.mark.parametrize("split", [1, 7, 64, 65])
def test_split_anywhere_carries_the_state(split: int) -> None:
    """Two calls split at any token give the one call's outputs and final state."""
    q, k, v, g, beta, state = inputs(100, 3)
    whole, whole_s = chunk_gated_delta_rule(q, k, v, g, beta, state)
    a, s = chunk_gated_delta_rule(q[:split], k[:split], v[:split], g[:split], beta[:split], state)
    b, s = chunk_gated_delta_rule(q[split:], k[split:], v[split:], g[split:], beta[split:], s)
    torch.testing.assert_close(torch.cat([a, b]), whole, atol=TOL, rtol=TOL)
    torch.testing.assert_close(s, whole_s, atol=TOL, rtol=TOL)


@pytest.mark.parametrize("n", [3, 70])
def test_both_forms_equal_transformers(n: int) -> None:
    """transformers normalises and scales q, k itself (`use_qk_l2norm_in_kernel`): it is given the
    raw vectors, ours the normalised ones."""
    gen = torch.Generator().manual_seed(n)
    raw_q, raw_k = torch.randn(n, H, DK, generator=gen), torch.randn(n, H, DK, generator=gen)
    v, g, beta = torch.randn(n, H, DV, generator=gen), -torch.rand(n, H, generator=gen), torch.rand(n, H, generator=gen)
    state = torch.randn(H, DK, DV, generator=gen) * 0.3
    q = hf.l2norm(raw_q, dim=-1, eps=1e-6) * DK**-0.5
    k = hf.l2norm(raw_k, dim=-1, eps=1e-6)
    args = (raw_q[None], raw_k[None], v[None], g[None], beta[None])
    kw = dict(initial_state=state[None].clone(), output_final_state=True, use_qk_l2norm_in_kernel=True)
    want_c, want_cs = hf.torch_chunk_gated_delta_rule(*args, **kw)
    want_r, want_rs = hf.torch_recurrent_gated_delta_rule(*args, **kw)
    got, got_s = chunk_gated_delta_rule(q, k, v, g, beta, state)
    torch.testing.assert_close(got, want_c[0], atol=TOL, rtol=TOL)
    torch.testing.assert_close(got_s, want_cs[0], atol=TOL, rtol=TOL)
    got_r, got_rs = token_by_token(q, k, v, g, beta, state)
    torch.testing.assert_close(got_r, want_r[0], atol=TOL, rtol=TOL)
    torch.testing.assert_close(got_rs, want_rs[0], atol=TOL, rtol=TOL)


def test_conv_chunks_and_steps_equal_transformers() -> None:
    """A convolution over 9 inputs split 4 + 1 + 4 (a chunk, a step, a chunk) equals transformers'
    zero-padded causal conv over all 9, and ends in the state holding the last K - 1 inputs."""
    gen = torch.Generator().manual_seed(0)
    C, K, n = 5, 4, 9
    x, weight = torch.randn(n, C, generator=gen), torch.randn(C, K, generator=gen)
    want = hf.causal_conv1d_fn(x.t()[None], weight, None, activation=None)[0].t()  # [n, C]
    state = torch.zeros(C, K - 1)
    a, state = causal_conv1d(x[:4], state, weight)
    b, state = causal_conv1d_step(x[4:5], state[None], weight)
    c, state = causal_conv1d(x[5:], state[0], weight)
    torch.testing.assert_close(torch.cat([a, b, c]), want, atol=TOL, rtol=TOL)
    torch.testing.assert_close(state, x[-(K - 1) :].t())


@pytest.mark.parametrize("native", [True, False], ids=["kernel", "torch"])
def test_in_place_decode_step_updates_only_its_slots(native: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The decode rows' in-place forms (the C++ kernel, and the torch gather / scatter without it)
    equal the reference on the rows' states, with key heads each serving two value heads (value
    head h reads key head h // 2), and leave every other slot of the pool untouched."""
    if native and gated_delta._KERNEL is None:
        pytest.skip("the gated delta extension is not built on this machine")
    if not native:
        monkeypatch.setattr(gated_delta, "_KERNEL", None)
    gen = torch.Generator().manual_seed(3)
    B, HK, HV, C, K = 3, 2, 4, 20, 4
    slots = torch.tensor([5, 0, 2])
    q = F.normalize(torch.randn(B, HK, DK, generator=gen), dim=-1) * DK**-0.5
    k = F.normalize(torch.randn(B, HK, DK, generator=gen), dim=-1)
    v, g, beta = torch.randn(B, HV, DV, generator=gen), -torch.rand(B, HV, generator=gen), torch.rand(B, HV, generator=gen)
    pool = torch.randn(7, HV, DK, DV, generator=gen)
    before = pool.clone()
    out = gated_delta.recurrent_gated_delta_(q, k, v, g, beta, pool, slots)
    want, new = recurrent_gated_delta_rule(
        q.repeat_interleave(2, dim=1), k.repeat_interleave(2, dim=1), v, g, beta, before[slots]
    )
    torch.testing.assert_close(out, want, atol=TOL, rtol=TOL)
    torch.testing.assert_close(pool[slots], new, atol=TOL, rtol=TOL)
    others = [s for s in range(7) if s not in slots.tolist()]
    assert torch.equal(pool[others], before[others])

    x, weight = torch.randn(B, C, generator=gen).bfloat16(), torch.randn(C, K, generator=gen).bfloat16()
    conv = torch.randn(7, C, K - 1, generator=gen)
    conv_before = conv.clone()
    got = gated_delta.causal_conv1d_step_(x, conv, weight, slots)
    want_out, want_state = causal_conv1d_step(x, conv_before[slots], weight)
    torch.testing.assert_close(got, want_out, atol=TOL, rtol=TOL)
    assert torch.equal(conv[slots], want_state)
    assert torch.equal(conv[others], conv_before[others])
