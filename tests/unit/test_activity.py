"""The dashboard's bounded history (server/operations/activity.py): tokens land in the bucket of
their time, the series covers exactly the span (the bucket still filling left out, gaps as
zeros), and neither the buckets nor the recent requests grow past their bounds."""

from __future__ import annotations

from freetoken.server.operations.activity import Activity, FinishedRequest, Throughput


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_buckets_and_series() -> None:
    clock = FakeClock()
    tp = Throughput(bucket_s=2.0, span_s=10.0, clock=clock)
    tp.add(prefill=10, decode=4)
    tp.add(decode=2)
    assert tp.series() == [(0.0, 0.0)] * 5  # the bucket now filling is not shown yet
    clock.now += 2.0
    tp.add(decode=8)
    assert tp.series()[-1] == (5.0, 3.0)
    clock.now += 4.0  # one empty bucket between
    assert tp.series()[-3:] == [(5.0, 3.0), (0.0, 4.0), (0.0, 0.0)]
    clock.now += 100.0
    assert tp.series() == [(0.0, 0.0)] * 5  # older than the span: gone


def test_bounded() -> None:
    clock = FakeClock()
    tp = Throughput(bucket_s=1.0, span_s=30.0, clock=clock)
    for _ in range(1000):
        tp.add(decode=1)
        clock.now += 1.0
    assert len(tp._buckets) <= 31 and len(tp.series()) == 30
    activity = Activity(throughput=tp)
    for i in range(500):
        activity.finished(FinishedRequest(float(i), "chat", 200, 10, 0, i, 0.1, 0.2, "stop", None))
    doc = activity.document()
    assert len(doc["recent"]) == 50 and doc["recent"][0]["completion_tokens"] == 499  # newest first
    assert doc["throughput"]["bucket_s"] == 1.0 and len(doc["throughput"]["series"]) == 30
