"""The engine process, its supervisor and the API-side client, with real processes over a tiny
model: streaming, concurrency, refusals, aborts releasing pages, a SIGKILL mid-stream ending the
stream with an error and the engine coming back, and a clean stop leaving no child behind."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from procs import LoopRunner, engine_children, poll_until  # noqa: E402
from tiny_models import write_tiny_model  # noqa: E402

from freetoken.config import EngineConfig  # noqa: E402
from freetoken.request import SamplingParams  # noqa: E402
from freetoken.server.process import messages as m  # noqa: E402
from freetoken.server.process.client import EarlyEngine, EngineClient, EngineRefused, EngineUnavailable  # noqa: E402
from freetoken.server.process.supervisor import RestartPolicy  # noqa: E402

PROMPT = [5, 17, 33, 60, 61, 62, 99, 120, 7, 8, 9]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def engine_config(model: Path) -> EngineConfig:
    return EngineConfig(
        model=str(model), dtype="float64", page_size=4, num_tokens=512, max_running_requests=4,
        max_prefill_length=32, max_waiting_requests=8, threads=1, debug_kv=True,
    )


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model("gemma3", tmp_path_factory.mktemp("engine_process_gemma"))


@pytest.fixture(scope="module")
def runner() -> Iterator[LoopRunner]:
    r = LoopRunner()
    yield r
    r.close()


@pytest.fixture(scope="module")
def client(runner: LoopRunner, model_dir: Path) -> Iterator[EngineClient]:
    c = EngineClient(engine_config(model_dir), served_name="tiny")
    runner.run(c.start())
    assert c.state == "loading"
    assert runner.run(c.wait_ready(180)), c.reason
    yield c
    runner.run(c.stop())


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> dict[str, list[int]]:
    """Greedy ids of PROMPT from an engine in this process (the worker's loop, no sockets)."""
    from freetoken.engine.build import build_engine
    from freetoken.server.process.worker import WorkerLoop

    engine, _ = build_engine(engine_config(model_dir))
    sent: list[object] = []
    loop = WorkerLoop(engine, sent.append)
    params = {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(GREEDY).items()}
    loop.apply(m.AddRequest("ref", PROMPT, params))
    while engine.has_work():
        loop.tick()
    return {"ids": [t for u in sent if isinstance(u, m.TokenUpdate) for t in u.token_ids]}


async def collect(client: EngineClient, rid: str, prompt: list[int], params: SamplingParams) -> list[m.TokenUpdate]:
    return [u async for u in client.generate(rid, prompt, params, eos_ids=[2])]


async def pages_in_use(client: EngineClient) -> int:
    status = await client.status()
    pools = status["pools"]
    assert isinstance(pools, dict)
    return sum(p["in_use"] for p in pools.values())


async def idle_and_released(client: EngineClient) -> bool:
    status = await client.status()
    counters = status["engine"]
    assert isinstance(counters, dict)
    return counters["running"] == 0 and counters["waiting"] == 0 and await pages_in_use(client) == 0


# -- no processes -------------------------------------------------------------------------


def test_messages_round_trip() -> None:
    samples = [
        m.AddRequest("r1", [1, 2, 3], {"max_tokens": 4, "stop": ["x"], "seed": None}, [2], [3]),
        m.AbortRequest("r1"), m.FinishRequest("r1"), m.StatusQuery(7), m.Shutdown(),
        m.Ready("tiny", "gemma3", 320, 1024, "swa_radix", 4, 1234),
        m.TokenUpdate("r1", [5, 6], [[5, -0.5, [[5, -0.5], [9, -1.0]]], None], True, "stop", None, 4, [None]),
        m.Refused("r1", "too long", "context_length_exceeded", "max_tokens"),
        m.StatusReply(7, {"pools": {"full": {"capacity": 10}}}), m.EngineError("boom"),
    ]
    for msg in samples:
        assert m.decode(m.encode(msg)) == msg
    with pytest.raises(TypeError):
        m.encode(object())


def test_restart_policy_backs_off_then_gives_up() -> None:
    policy = RestartPolicy(first_delay_s=0.5, max_delay_s=3.0, max_restarts=4, window_s=100.0)
    times: list[float] = []
    delays = []
    for t in (0.0, 1.0, 2.0, 3.0):
        times.append(t)
        delays.append(policy.next_delay(times, t))
    assert delays == [0.5, 1.0, 2.0, 3.0]
    assert policy.next_delay([*times, 4.0], 4.0) is None
    # exits older than the window no longer count
    assert policy.next_delay([*times, 4.0, 150.0], 150.0) == 0.5


def test_worker_loop_ends_a_failed_step_with_an_error_and_serves_on(model_dir: Path) -> None:
    from freetoken.engine.build import build_engine
    from freetoken.server.process.worker import WorkerLoop

    engine, _ = build_engine(engine_config(model_dir))
    sent: list[object] = []
    loop = WorkerLoop(engine, sent.append)
    params = {"max_tokens": 3, "temperature": 0.0, "ignore_eos": True}
    forward = engine.runner.forward

    def broken(*args: object) -> object:
        engine.runner.forward = forward  # type: ignore[method-assign]  # fail once
        raise RuntimeError("simulated device failure")

    engine.runner.forward = broken  # type: ignore[method-assign]
    loop.apply(m.AddRequest("a", PROMPT, params))
    loop.tick()
    assert sent == [m.TokenUpdate("a", [], finished=True, finish_reason="error", error=sent[0].error)]  # type: ignore[attr-defined]
    assert "simulated device failure" in sent[0].error  # type: ignore[attr-defined]
    loop.apply(m.AddRequest("b", PROMPT, params))
    while engine.has_work():
        loop.tick()
    updates = [u for u in sent[1:] if isinstance(u, m.TokenUpdate)]
    assert {u.rid for u in updates} == {"b"}  # the engine's own late update for "a" is not repeated
    assert sum(len(u.token_ids) for u in updates) == 3 and updates[-1].finish_reason == "length"
    loop.apply(m.StatusQuery(1))
    status = sent[-1]
    assert isinstance(status, m.StatusReply)
    assert status.status["engine"]["step_failures"] == 1  # type: ignore[index]
    assert status.status["integrity"]["violations"] == 0  # type: ignore[index]


def test_worker_loop_refuses_bad_requests(model_dir: Path) -> None:
    from freetoken.engine.build import build_engine
    from freetoken.server.process.worker import WorkerLoop

    engine, _ = build_engine(engine_config(model_dir))
    sent: list[object] = []
    loop = WorkerLoop(engine, sent.append)
    loop.apply(m.AddRequest("t", PROMPT, {"temperature": -1.0}))
    loop.apply(m.AddRequest("u", PROMPT, {"no_such_field": 1}))
    loop.apply(m.AddRequest("v", [1] * 1020, {"max_tokens": 16}))
    for i in range(4 + 8):  # max_running_requests + max_waiting_requests fit; the next does not
        loop.apply(m.AddRequest(f"q{i}", PROMPT, {"max_tokens": 2}))
    loop.apply(m.AddRequest("full", PROMPT, {"max_tokens": 2}))
    refused = {r.rid: r for r in sent if isinstance(r, m.Refused)}
    assert set(refused) == {"t", "u", "v", "full"}
    assert (refused["t"].code, refused["t"].param) == ("invalid_request", "temperature")
    assert "no_such_field" in refused["u"].message
    assert refused["v"].code == "context_length_exceeded"
    assert refused["full"].code == "queue_full"


# -- one engine process for the module ------------------------------------------------------


def test_generate_streams_the_same_tokens_as_an_in_process_engine(
    runner: LoopRunner, client: EngineClient, reference: dict[str, list[int]]
) -> None:
    assert client.info is not None and client.info.model_name == "tiny" and client.info.architecture == "gemma3"
    assert client.info.pid == client.pid and client.info.page_size == 4
    updates = runner.run(collect(client, "g1", PROMPT, GREEDY))
    assert len(updates) > 1  # streamed, not one lump
    assert [t for u in updates for t in u.token_ids] == reference["ids"]
    assert updates[-1].finished and updates[-1].finish_reason == "length"
    assert all(not u.finished for u in updates[:-1])
    assert client.num_in_flight == 0


def test_concurrent_generates_each_get_their_own_tokens(
    runner: LoopRunner, client: EngineClient, reference: dict[str, list[int]]
) -> None:
    async def many() -> list[list[m.TokenUpdate]]:
        other = [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]
        return await asyncio.gather(*(
            collect(client, f"c{i}", PROMPT if i % 2 == 0 else other, GREEDY) for i in range(6)  # 6 > 4 running
        ))

    results = runner.run(many())
    for i, updates in enumerate(results):
        ids = [t for u in updates for t in u.token_ids]
        assert len(ids) == 8 and updates[-1].finish_reason == "length"
        if i % 2 == 0:
            assert ids == reference["ids"]
    assert runner.run(poll_until(lambda: idle_and_released(client), 30))


def test_refused_requests_raise_engine_refused(runner: LoopRunner, client: EngineClient) -> None:
    with pytest.raises(EngineRefused) as info:
        runner.run(collect(client, "long", [1] * 1020, SamplingParams(max_tokens=16)))
    assert info.value.code == "context_length_exceeded" and info.value.param == "max_tokens"
    with pytest.raises(EngineRefused) as info:
        runner.run(collect(client, "hot", PROMPT, SamplingParams(temperature=500.0)))
    assert info.value.param == "temperature"
    assert client.num_in_flight == 0 and client.state == "ready"


def test_early_close_abort_and_finish_release_pages(runner: LoopRunner, client: EngineClient) -> None:
    long = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)

    async def scenario() -> tuple[str | None, str | None]:
        stream = client.generate("early", PROMPT, long, eos_ids=[2])
        first = await stream.__anext__()
        assert first.token_ids and not first.finished
        await stream.aclose()  # the consumer went away: an AbortRequest frees its pages
        assert client.num_in_flight == 0

        reasons: list[str | None] = []
        for rid, end in (("aborted", client.abort), ("stopped", client.finish)):
            async for update in client.generate(rid, PROMPT, long, eos_ids=[2]):
                if not update.finished and update.token_ids:
                    await end(rid)
                if update.finished:
                    reasons.append(update.finish_reason)
        return reasons[0], reasons[1]

    assert runner.run(scenario()) == ("abort", "stop")
    assert runner.run(poll_until(lambda: idle_and_released(client), 30))
    status = runner.run(client.status())
    assert status["integrity"]["violations"] == 0  # type: ignore[index]


def test_a_killed_engine_ends_streams_with_an_error_and_comes_back(runner: LoopRunner, client: EngineClient) -> None:
    old_pid, restarts_before = client.pid, client.restarts  # the module's client: count this test's own
    assert old_pid is not None
    long = SamplingParams(max_tokens=480, temperature=0.0, ignore_eos=True)

    async def killed_mid_stream() -> tuple[list[m.TokenUpdate], str]:
        updates = []
        state_after = ""
        async for update in client.generate("victim", PROMPT, long, eos_ids=[2]):
            updates.append(update)
            if len(updates) == 1:
                os.kill(old_pid, signal.SIGKILL)
            if update.finished:
                state_after = client.state
        return updates, state_after

    updates, state_after = runner.run(killed_mid_stream())
    last = updates[-1]
    assert last.finished and last.finish_reason == "error"
    assert last.error is not None and "SIGKILL" in last.error
    assert sum(len(u.token_ids) for u in updates) < 480
    assert state_after != "ready" and client.num_in_flight == 0
    with pytest.raises(EngineUnavailable):
        client.generate("too-soon", PROMPT, GREEDY, eos_ids=[2])
    assert runner.run(client.wait_ready(180)), client.reason
    assert client.restarts == restarts_before + 1 and client.pid != old_pid and client.info is not None and client.info.pid == client.pid
    again = runner.run(collect(client, "after", PROMPT, GREEDY))
    assert again[-1].finish_reason == "length" and sum(len(u.token_ids) for u in again) == 8


# -- their own engine processes -------------------------------------------------------------


def test_stop_leaves_no_child_process(model_dir: Path) -> None:
    before = {p.pid for p in engine_children()}  # the module's client may be running

    async def scenario() -> None:
        c = EngineClient(engine_config(model_dir), served_name="tiny")
        await c.start()
        assert await c.wait_ready(180), c.reason
        pid = c.pid
        updates = await collect(c, "s", PROMPT, GREEDY)
        assert updates[-1].finished
        await c.stop()
        assert c.state == "down" and pid not in [p.pid for p in engine_children()]

        loading = EngineClient(engine_config(model_dir), served_name="tiny")
        await loading.start()
        await loading.stop(timeout=0.5)  # still importing: terminated
        assert loading.state == "down"
        with pytest.raises(EngineUnavailable):
            await loading.status()

    asyncio.run(scenario())
    assert {p.pid for p in engine_children()} == before


def test_an_early_engine_is_adopted_as_the_first_incarnation_or_ended_unadopted(model_dir: Path) -> None:
    """`ft serve` starts the engine before the web stack: the client serves from that process,
    and one the client never started is ended with it."""
    before = {p.pid for p in engine_children()}

    async def scenario() -> None:
        early = EarlyEngine.start(engine_config(model_dir), "tiny")
        c = EngineClient(engine_config(model_dir), served_name="tiny", early=early)
        await c.start()
        assert await c.wait_ready(180), c.reason
        assert c.pid == early.process.pid and c.restarts == 0
        updates = await collect(c, "e", PROMPT, GREEDY)
        assert updates[-1].finished and sum(len(u.token_ids) for u in updates) == GREEDY.max_tokens
        await c.stop()
        assert early.process.exitcode is not None

        unadopted = EarlyEngine.start(engine_config(model_dir), "tiny")
        never = EngineClient(engine_config(model_dir), served_name="tiny", early=unadopted)
        await never.stop()
        assert unadopted.process.exitcode is not None and not Path(unadopted.directory).exists()

    asyncio.run(scenario())
    assert {p.pid for p in engine_children()} == before


def test_an_engine_that_cannot_load_its_model_is_down_with_the_reason(tmp_path: Path) -> None:
    before = {p.pid for p in engine_children()}

    async def scenario() -> tuple[str, str | None, int]:
        c = EngineClient(engine_config(tmp_path / "missing"), served_name="missing")
        await c.start()
        assert not await c.wait_ready(180)
        seen = (c.state, c.reason, c.restarts)
        await c.stop()
        return seen

    state, reason, restarts = asyncio.run(scenario())
    assert state == "down" and restarts == 0
    assert reason is not None and "missing" in reason and "not restarting" in reason
    assert {p.pid for p in engine_children()} == before


def test_a_held_engine_waits_for_its_release_or_for_its_parent_to_go() -> None:
    from freetoken.server.process.supervisor import wait_for_go

    class Go:  # a multiprocessing Event, stepped by the test
        def __init__(self, set_after: int | None) -> None:
            self.calls, self.set_after = 0, set_after

        def wait(self, timeout: float | None = None) -> bool:
            self.calls += 1
            return self.set_after is not None and self.calls > self.set_after

    released = Go(set_after=3)
    assert wait_for_go(released, 100, lambda: 100) and released.calls == 4
    parents = iter([100, 100, 1])  # reparented on the third check: the API process is gone
    orphan = Go(set_after=None)
    assert not wait_for_go(orphan, 100, lambda: next(parents)) and orphan.calls == 3


def test_a_held_early_engine_is_ended_unreleased_and_serves_once_released(model_dir: Path) -> None:
    before = {p.pid for p in engine_children()}

    async def scenario() -> None:
        held = EarlyEngine.start(engine_config(model_dir), "tiny", held=True)
        held.abandon()  # a check refused the configuration: ended, directory removed
        assert held.process.exitcode is not None and not Path(held.directory).exists()

        early = EarlyEngine.start(engine_config(model_dir), "tiny", held=True)
        c = EngineClient(engine_config(model_dir), served_name="tiny", early=early)
        early.release()
        await c.start()
        assert await c.wait_ready(180), c.reason
        updates = await collect(c, "h", PROMPT, GREEDY)
        assert updates[-1].finished
        await c.stop()

    asyncio.run(scenario())
    assert {p.pid for p in engine_children()} == before
