"""The heartbeat judgement without processes: the deadline counts from Ready and between beats
of a serving engine (never during the model load), a long-running step keeps an engine alive as long
as its beats come, and the longest gap is kept for /metrics."""

from __future__ import annotations

from freetoken.server.process.heartbeat import HeartbeatWatch, Progress
from freetoken.server.process.messages import Heartbeat, decode, encode


def beat(phase: str = "serving", steps: int = 0, running: float = 0.0) -> Heartbeat:
    return Heartbeat(pid=1, phase=phase, steps=steps, step_running_s=running)


def test_loading_beats_start_no_deadline() -> None:
    watch = HeartbeatWatch(timeout_s=5.0)
    watch.saw(beat("loading"), now=0.0)
    assert not watch.overdue(now=1000.0) and watch.silence_s(1000.0) is None
    watch.saw(beat("serving"), now=1000.0)
    assert not watch.overdue(now=1004.0)
    assert watch.overdue(now=1005.5)


def test_the_deadline_starts_at_ready_even_without_a_serving_beat() -> None:
    watch = HeartbeatWatch(timeout_s=5.0)
    watch.saw(beat("loading"), now=0.0)
    watch.ready(now=10.0)  # then frozen before its first serving beat
    assert not watch.overdue(now=14.0) and watch.overdue(now=15.5)
    watch.saw(beat("serving"), now=15.0)
    watch.ready(now=99.0)  # a late Ready does not move the clock
    assert watch.silence_s(16.0) == 1.0


def test_a_long_step_with_beats_is_alive_and_gaps_are_kept() -> None:
    watch = HeartbeatWatch(timeout_s=5.0)
    for i in range(40):  # one step running for 20 s, beating every 0.5 s
        watch.saw(beat(steps=7, running=0.5 * i), now=0.5 * i)
        assert not watch.overdue(now=0.5 * i + 0.4)
    watch.saw(beat(steps=8), now=23.0)  # a 3.5 s gap
    assert watch.max_gap_s == 23.0 - 19.5 and not watch.overdue(now=27.9) and watch.overdue(now=28.1)


def test_progress_beat_reports_the_running_step_and_travels() -> None:
    progress = Progress(phase="serving", steps=3)
    assert progress.beat(pid=42).step_running_s == 0.0
    progress.step_started = 0.0  # monotonic time 0: the step has run "forever"
    msg = progress.beat(pid=42)
    assert msg.steps == 3 and msg.step_running_s > 0
    assert decode(encode(msg)) == msg
