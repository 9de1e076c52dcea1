"""Real K/V tensors under traffic with run-time resizes (`KVTensors.resize`, float and int8).

The tiny random Gemma 3 (float64, window 7 over pages of 4; conftest.py) serves a seeded stream
of greedy requests over shared heads, with aborts and resizes of both pools between steps
(grows, shrinks below what the tree holds, shrinks that wait for running requests), so the
tensors are reallocated while requests hold pages in them -- with `--kv-cache-dtype int8` their
scale tensors too. Checked:

- every forward: each row a query could read (FULL layers: every earlier position; sliding
  layers: the window) sits in a slot whose bytes -- the K and V rows of every layer of its pool
  and, for int8, their scales -- are exactly those written to it, and that write was of the
  reading request's own prefix at that position (an exact prefix id, as in the KV tests'
  shadow model). A record of every write is kept apart from the tensors, so a resize that drops
  or moves a page, a row or a scale fails here;
- the greedy outputs equal those of the same traffic without resizes (on a pool that never
  changes), and the resizes really happened under traffic (a shrink waited for running
  requests and then completed; the tensors changed size while requests held pages);
- page 0 of every layer stays zero, and the pools balance at idle.
"""

from __future__ import annotations

import random
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit" / "kv"))

from shadow import PrefixIds  # noqa: E402

from freetoken.config import EngineConfig  # noqa: E402
from freetoken.engine.build import build_engine_for  # noqa: E402
from freetoken.engine.engine import Engine, RequestRefused  # noqa: E402
from freetoken.engine.resize import ResizeRefused  # noqa: E402
from freetoken.engine.scheduler import ScheduledItem  # noqa: E402
from freetoken.kv.tensors import KVTensors  # noqa: E402
from freetoken.request import FinishReason, Request, SamplingParams  # noqa: E402

P = 4
FULL_PAGES = 40
SWA_PAGES = 28  # the floor is 16 (4 running, chunks of 12, window 7)
MAX_PAGES = 2 * FULL_PAGES  # no pool grows past this (the record is sized for it)


class Rows:
    """What every slot of one pool was last written with, kept apart from the tensors: the
    prefix id and, per layer of the pool, a copy of the K and V rows (and int8 scales)."""

    def __init__(self, engine: Engine, sliding: bool) -> None:
        tensors = engine.runner.kv_tensors  # type: ignore[attr-defined]
        self.tensors = tensors
        self.layers = [i for i, s in enumerate(tensors.sliding) if s == sliding]
        self.pid = np.full(((MAX_PAGES + 1) * P,), -1, dtype=np.int64)
        self.copy: dict[int, list[torch.Tensor]] = {}
        for layer in self.layers:
            parts = [tensors.k[layer], tensors.v[layer]]
            if tensors.quantized:
                parts += [tensors.k[layer].kv_scale, tensors.v[layer].kv_scale]
            self.copy[layer] = [torch.zeros(((MAX_PAGES + 1) * P, *t.shape[2:]), dtype=t.dtype) for t in parts]

    def _parts(self, layer: int) -> list[torch.Tensor]:
        t = self.tensors
        parts = [t.k[layer], t.v[layer]]
        if t.quantized:
            parts += [t.k[layer].kv_scale, t.v[layer].kv_scale]
        return [p.reshape(-1, *p.shape[2:]) for p in parts]  # [slots, ...]

    def wrote(self, slots: list[int], pids: list[int]) -> None:
        idx = torch.tensor(slots, dtype=torch.long)
        self.pid[slots] = pids
        for layer in self.layers:
            for mine, real in zip(self.copy[layer], self._parts(layer)):
                mine[idx] = real[idx]

    def check(self, who: str, slots: list[int], pids: list[int]) -> None:
        got = self.pid[slots]
        bad = np.nonzero(got != np.asarray(pids))[0]
        assert not len(bad), (f"{who} reads slot {slots[bad[0]]}, last written with prefix {got[bad[0]]}, "
                              f"not its own ({pids[bad[0]]})")
        idx = torch.tensor(slots, dtype=torch.long)
        for layer in self.layers:
            for name, mine, real in zip(("K", "V", "K scale", "V scale"), self.copy[layer], self._parts(layer)):
                same = (real[idx] == mine[idx]).reshape(len(slots), -1).all(dim=1)
                if not bool(same.all()):
                    slot = slots[int((~same).nonzero()[0])]
                    raise AssertionError(f"{who} reads slot {slot} of layer {layer}: its {name} is not what was written")


class ContentCheck:
    """Wraps the engine's runner: after each forward, record its writes, then check every row
    its queries could read (see the module docstring)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.window = engine.kv.window
        self.ids = PrefixIds()
        self.pools = {"full": Rows(engine, False), "swa": Rows(engine, True)}
        self.reads = 0
        self._forward = engine.runner.forward
        engine.runner.forward = self.forward  # type: ignore[method-assign]

    def forward(self, items: list[ScheduledItem]) -> torch.Tensor:
        logits = self._forward(items)
        plan = []
        for item in items:
            req = item.req
            ids = self.ids.chain(0, req.token_slice(0, item.start + item.n))
            full, swa = self.engine.kv.page_tables(req.rid)
            for kind, table in (("full", full), ("swa", swa)):
                slots = [int(table[pos // P]) * P + pos % P for pos in range(item.start, item.start + item.n)]
                self.pools[kind].wrote(slots, ids[item.start : item.start + item.n])
            plan.append((req.rid, ids, full, swa, item.start + item.n, item.start))
        for rid, ids, full, swa, end, start in plan:  # after every write of the step
            lo = max(0, start - self.window + 1)
            for kind, table, first in (("full", full, 0), ("swa", swa, lo)):
                slots = [int(table[k // P]) * P + k % P for k in range(first, end)]
                assert all(s >= P for s in slots), f"{rid} reads a NULL {kind} entry"
                self.pools[kind].check(rid, slots, ids[first:end])
                self.reads += len(slots)
        return logits


@dataclass
class Traffic:
    """A seeded schedule of arrivals, steps, aborts and (only where `resizes`) pool resizes."""

    seed: int
    events: list[tuple] = field(default_factory=list)

    def __post_init__(self) -> None:
        rng = random.Random(self.seed)
        heads = [[rng.randrange(3, 320) for _ in range(rng.randrange(10, 30))] for _ in range(3)]
        n = 0
        for _ in range(240):
            act = rng.random()
            if act < 0.2 and n < 40:
                head = rng.choice(heads)[: rng.randrange(0, 31)]
                prompt = head + [rng.randrange(3, 320) for _ in range(rng.randrange(1, 12))]
                self.events.append(("arrive", f"r{n}", prompt, rng.randrange(2, 12)))
                n += 1
            elif act < 0.8:
                self.events.append(("step",))
            elif act < 0.83:
                self.events.append(("abort", rng.randrange(1 << 16)))
            else:
                self.events.append(("resize", rng.choice(["full", "full", "swa"]), rng.uniform(0.45, 1.6)))


def play(engine: Engine, traffic: Traffic, resizes: bool) -> tuple[dict[str, Request], set[str], dict[str, int]]:
    reqs: dict[str, Request] = {}
    aborted: set[str] = set()
    seen = {"shrink waited": 0, "shrink completed after waiting": 0, "tensors resized under traffic": 0}
    waiting: set[str] = set()
    tensors = engine.runner.kv_tensors  # type: ignore[attr-defined]

    def step() -> None:
        sizes = (tensors.num_full_pages, tensors.num_swa_pages)
        for upd in engine.step():
            assert upd.finish_reason is not FinishReason.ERROR, upd.error
        if (tensors.num_full_pages, tensors.num_swa_pages) != sizes and engine.kv.request_ids:
            seen["tensors resized under traffic"] += 1
        for kind in list(waiting):
            if engine.kv.status()["pools"][kind]["pending_release"] == 0:
                waiting.discard(kind)
                seen["shrink completed after waiting"] += 1

    for event in traffic.events:
        if event[0] == "arrive":
            _, rid, prompt, max_tokens = event
            req = Request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
            try:
                engine.add_request(req)
            except RequestRefused:  # past a pool shrunk below it: not in either run's comparison
                continue
            reqs[rid] = req
        elif event[0] == "step":
            step()
        elif event[0] == "abort":
            live = sorted(r for r, q in reqs.items() if not q.finished)
            if live:
                rid = live[event[1] % len(live)]
                engine.abort(rid)
                aborted.add(rid)
        elif resizes:
            _, kind, share = event
            start = FULL_PAGES if kind == "full" else SWA_PAGES
            pages = min(MAX_PAGES, max(1, int(start * share)))
            sizes = (tensors.num_full_pages, tensors.num_swa_pages)
            try:
                out = engine.resize(**{f"{kind}_tokens": pages * P})
            except ResizeRefused:
                continue
            if (tensors.num_full_pages, tensors.num_swa_pages) != sizes and engine.kv.request_ids:
                seen["tensors resized under traffic"] += 1
            if out[kind]["pending_release"]:
                seen["shrink waited"] += 1
                waiting.add(kind)
    for _ in range(2000):
        if not engine.has_work():
            break
        step()
    assert not engine.has_work() and not engine.kv.shrinking()
    return reqs, aborted, seen


def make_engine(tiny_gemma, cache_dtype: str) -> Engine:  # type: ignore[no-untyped-def]
    config = EngineConfig(
        model="tiny", dtype="float64", page_size=P, num_tokens=FULL_PAGES * P, swa_pool_tokens=SWA_PAGES * P,
        max_running_requests=4, max_prefill_length=12, debug_kv=True, kv_cache_dtype=cache_dtype,
    )
    return build_engine_for(config, tiny_gemma)


@pytest.fixture(scope="module")
def one_thread():  # type: ignore[no-untyped-def]
    """A tiny model: torch's thread pool only contends on a shared machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("cache_dtype", ["auto", "int8"])
def test_resizes_under_traffic_keep_every_row_and_the_outputs(tiny_gemma, one_thread, cache_dtype: str) -> None:
    traffic = Traffic(seed=11)
    engine = make_engine(tiny_gemma, cache_dtype)
    assert engine.runner.kv_tensors.quantized == (cache_dtype == "int8")  # type: ignore[attr-defined]
    check = ContentCheck(engine)
    reqs, aborted, seen = play(engine, traffic, resizes=True)

    plain = make_engine(tiny_gemma, cache_dtype)
    ContentCheck(plain)  # the same check without resizes
    base, base_aborted, _ = play(plain, traffic, resizes=False)

    compared = [rid for rid in reqs if rid in base and rid not in aborted | base_aborted]
    assert len(compared) >= 20, compared
    for rid in compared:
        assert reqs[rid].finish_reason is FinishReason.LENGTH
        assert reqs[rid].output_ids == base[rid].output_ids, rid
    assert engine.scheduler.preemptions > 0, "the pools were meant to force preemption"
    assert seen["shrink waited"] and seen["shrink completed after waiting"], seen
    assert seen["tensors resized under traffic"] >= 2, seen
    assert check.reads > 5_000, check.reads
    tensors = engine.runner.kv_tensors  # type: ignore[attr-defined]
    assert tensors.null_pages_are_zero()
    for kind, pool in engine.status()["pools"].items():
        assert pool["in_use"] == 0 and pool["free"] + pool["cached"] == pool["capacity"], (kind, pool)
        assert (tensors.num_full_pages if kind == "full" else tensors.num_swa_pages) == pool["capacity"]


@pytest.mark.parametrize("bug,cache_dtype", [("drop_scales", "int8"), ("lose_last_page", "auto"), ("lose_last_page", "int8")])
def test_a_resize_that_loses_content_fails_the_check(tiny_gemma, one_thread, monkeypatch, bug: str,
                                                     cache_dtype: str) -> None:
    """Negative control: `KVTensors.resize` without the int8 scale copy, or copying one page
    fewer, makes a read under the same traffic find bytes other than those written."""
    from mixed_bugs import _resize_tensors  # the same injected resizes as the mixed KV driver's

    monkeypatch.setattr(KVTensors, "resize", _resize_tensors(drop_scales=bug == "drop_scales",
                                                              lose_last_page=bug == "lose_last_page"))
    engine = make_engine(tiny_gemma, cache_dtype)
    ContentCheck(engine)
    with pytest.raises(AssertionError, match="is not what was written"):
        play(engine, Traffic(seed=11), resizes=True)
