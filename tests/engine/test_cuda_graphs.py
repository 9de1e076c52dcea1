"""The bookkeeping of CUDA graphs for decode (engine/cuda_graphs.py), on CPU: no GPU is pretended.
The capture and replay are torch.cuda's and run only on a device (tests/gpu, scripts/gpu_check.sh);
here a stand-in "records" the forward and "replays" it by running it again over the same static
buffers, so what is checked is everything around the graph: the bucket a step takes, that one
set of static buffers serves every bucket and is filled in place, that a step of B requests in a
bucket of b > B computes the same logits as the eager forward and writes no page but its own
(page 0 stays zero), that each bucket is captured once (again only after a reset), and the eager
fallback for prefill chunks, drafted tokens, too many requests, a capture that fails, and any
device or model the graphs do not serve."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from freetoken.attention.metadata import ForwardBatch
from freetoken.config import EngineConfig
from freetoken.engine.build import load_for
from freetoken.engine.cuda_graphs import BUCKETS, DecodeGraphs, bucket_for, decode_graphs_for
from freetoken.errors import ConfigError
from freetoken.kv.tensors import KVTensors
from freetoken.request import SamplingParams


class Recorded:
    def __init__(self, fn) -> None:  # type: ignore[no-untyped-def]
        self.fn, self.out = fn, fn()


class Rerun:
    """Graph stand-in: capture runs the forward once; replay runs it again into the same output tensor."""

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.captures = 0
        self.replays = 0

    def capture(self, fn):  # type: ignore[no-untyped-def]
        if self.fail:
            raise RuntimeError("operation not permitted when stream is capturing")
        self.captures += 1
        graph = Recorded(fn)
        return graph, graph.out

    def replay(self, graph: Recorded) -> None:
        self.replays += 1
        graph.out.copy_(graph.fn())


def test_bucket_is_the_smallest_that_holds_the_step() -> None:
    assert [bucket_for(n) for n in (1, 2, 3, 5, 9, 33, 64)] == [1, 2, 4, 8, 16, 64, 64]
    assert bucket_for(65) is None and BUCKETS == (1, 2, 4, 8, 16, 32, 64)


P = 4
WIDTH = 16  # table columns the graphs read: 64 tokens


def setup(loaded, ops):  # type: ignore[no-untyped-def]
    kv = KVTensors(loaded.model.config.kv_layout(), 80, 80, P, loaded.dtype, "cpu")
    cfg = loaded.config
    window = cfg.sliding_window if cfg.has_swa else None
    graphs = DecodeGraphs(lambda ids, batch: loaded.model(ids, batch, kv), "cpu", P, WIDTH, cfg.has_swa, window, ops=ops)
    return kv, graphs, window


def prefilled(loaded, kv, window, lens: list[int], seed: int):  # type: ignore[no-untyped-def]
    """Requests of `lens` tokens prefilled eagerly into scattered pages (the same page ids in both
    pools); -> their tables and a generator for the next tokens."""
    rng = np.random.default_rng(seed)
    free = list(rng.permutation(np.arange(1, 81)))
    tables = [np.array([free.pop() for _ in range(WIDTH)], dtype=np.int32) for _ in lens]
    specs = [(0, n, t, t if window is not None else None) for n, t in zip(lens, tables)]
    ids = rng.integers(0, loaded.config.vocab_size, sum(lens)).tolist()
    batch = ForwardBatch.build(specs, P, sliding_window=window)
    loaded.model(torch.tensor(ids), batch, kv)
    return tables, rng


def decode_specs(tables, lens, window):  # type: ignore[no-untyped-def]
    return [(n, 1, t, t if window is not None else None) for n, t in zip(lens, tables)]


def eager(loaded, kv, window, ids, specs):  # type: ignore[no-untyped-def]
    batch = ForwardBatch.build(specs, P, sliding_window=window)
    return loaded.model(torch.tensor(ids), batch, kv)


def pools(kv: KVTensors) -> list[torch.Tensor]:
    return [t.clone() for t in (*kv.k, *kv.v)]


@torch.inference_mode()
def test_a_padded_bucket_gives_the_eager_logits_and_writes_only_the_steps_slots(tiny_gemma) -> None:
    ops = Rerun()
    kv, graphs, window = setup(tiny_gemma, ops)
    lens = [9, 22, 5]
    tables, rng = prefilled(tiny_gemma, kv, window, lens, seed=1)
    for step in range(3):  # bucket 4 for 3 requests: row 3 repeats row 0
        specs = decode_specs(tables, lens, window)
        ids = rng.integers(0, tiny_gemma.config.vocab_size, 3).tolist()
        before = pools(kv)
        got = graphs.run(ids, specs, [0, 1, 2])
        assert got is not None and got.shape[0] == 3
        slots = {int(t[n // P]) * P + n % P for n, t in zip(lens, tables)}
        for old, new in zip(before, (*kv.k, *kv.v)):
            changed = (old != new).flatten(2).any(dim=2).flatten().nonzero().flatten().tolist()
            assert set(changed) <= slots  # no page but the step's own was written
            assert (new[0] == 0).all()  # page 0 stays zero
        want = eager(tiny_gemma, kv, window, ids, specs)  # writes the same K/V again
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        lens = [n + 1 for n in lens]
    assert (ops.captures, ops.replays) == (1, 3) and set(graphs.graphs) == {4}


@torch.inference_mode()
def test_one_set_of_static_buffers_serves_every_bucket_and_is_filled_in_place(tiny_gemma) -> None:
    ops = Rerun()
    kv, graphs, window = setup(tiny_gemma, ops)
    lens = [7, 3, 12, 30, 2]
    tables, rng = prefilled(tiny_gemma, kv, window, lens, seed=2)
    ptrs = {name: t.data_ptr() for name, t in vars(graphs.static).items() if isinstance(t, torch.Tensor)}
    for n in (1, 2, 5, 2, 1, 5):
        specs = decode_specs(tables[:n], lens[:n], window)
        ids = [1] * n
        assert graphs.run(ids, specs, list(range(n))) is not None
        for i in range(n):
            lens[i] += 1
        batch = graphs.batch_of(bucket_for(n))
        assert batch.kv_lens.data_ptr() == ptrs["kv_lens"] and batch.full_table.data_ptr() == ptrs["full_table"]
    assert {name: t.data_ptr() for name, t in vars(graphs.static).items() if isinstance(t, torch.Tensor)} == ptrs
    assert set(graphs.graphs) == {1, 2, 8} and ops.captures == 3 and ops.replays == 6
    graphs.reset()  # the K/V tensors were reallocated: capture again
    graphs.run([1], decode_specs(tables[:1], lens[:1], window), [0])
    assert ops.captures == 4


@torch.inference_mode()
def test_steps_the_graphs_do_not_serve_run_eagerly(tiny_gemma) -> None:
    ops = Rerun()
    kv, graphs, window = setup(tiny_gemma, ops)
    t = np.arange(1, WIDTH + 1, dtype=np.int32)
    swa = t if window is not None else None
    assert graphs.run([1, 2], [(5, 2, t, swa)], [1]) is None  # a prefill chunk
    assert graphs.run([1], [(5, 1, t, swa)], []) is None  # no logits wanted (not a plain decode row)
    assert graphs.run([1] * 65, [(5, 1, t, swa)] * 65, list(range(65))) is None  # past the largest bucket
    assert graphs.run([1], [(WIDTH * P, 1, t, swa)], [0]) is None  # past the tables the graphs read
    null = t.copy()
    null[1] = 0
    assert graphs.run([1], [(5, 1, null, swa)], [0]) is None  # a NULL page: the eager path raises on it
    assert ops.captures == 0


@torch.inference_mode()
def test_a_failed_capture_leaves_that_bucket_eager(tiny_gemma) -> None:
    ops = Rerun(fail=True)
    kv, graphs, window = setup(tiny_gemma, ops)
    t = np.arange(1, WIDTH + 1, dtype=np.int32)
    spec = [(5, 1, t, t if window is not None else None)]
    assert graphs.run([1], spec, [0]) is None and graphs.failed == {1}
    ops.fail = False
    assert graphs.run([1], spec, [0]) is None and ops.captures == 0  # not tried again
    assert graphs.run([1, 1], spec * 2, [0, 1]) is not None  # another bucket still captures


def test_only_cuda_engines_get_graphs(tiny_gemma) -> None:
    kv = KVTensors(tiny_gemma.model.config.kv_layout(), 8, 8, P, tiny_gemma.dtype, "cpu")
    args = (tiny_gemma.model, kv, P, 64, True, 8, False, False)
    assert decode_graphs_for(True, *args) is None  # a CPU engine runs eagerly


def test_the_engine_steps_through_the_graphs_with_the_same_outputs(tiny_llama, make_llm) -> None:
    """A whole engine (radix cache, audit after every step) whose runner replays the stand-in graphs
    gives the same greedy tokens as one that runs every step eagerly."""
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = [[5, 9, 2, 7, 1, 3], [4, 4, 8], [6, 1, 2, 3, 9, 9, 7, 5, 4, 2, 1]]
    plain = make_llm(tiny_llama).generate(prompts, params)
    llm = make_llm(tiny_llama)
    runner = llm.engine.runner
    ops = Rerun()
    cfg = tiny_llama.config
    runner.graphs = DecodeGraphs(
        lambda ids, batch: runner.model(ids, batch, runner.kv_tensors), "cpu", 4, 64, cfg.has_swa,
        cfg.sliding_window if cfg.has_swa else None, ops=ops,
    )
    graphed = llm.generate(prompts, params)
    assert [o.token_ids for o in graphed] == [o.token_ids for o in plain]
    assert ops.captures >= 1 and ops.replays >= 5


def test_device_cuda_without_a_device_is_refused_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="--device cuda: no CUDA device"):
        load_for(EngineConfig(model="gemma3-270m", device="cuda"))
