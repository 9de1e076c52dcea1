"""`LLM.stream` (what `ft generate` prints as it decodes): its pieces join to `generate`'s text,
stop strings included (held back, then cut), and a stream closed early aborts its request and
leaves the pools balanced at idle."""

from __future__ import annotations

from collections.abc import Callable

from freetoken.llm import LLM
from freetoken.models.load import LoadedModel
from freetoken.request import SamplingParams

MakeLLM = Callable[..., LLM]  # the make_llm fixture (tests/engine/conftest.py)


def balanced_at_idle(llm: LLM) -> None:
    status = llm.engine.status()
    assert status["integrity"]["violations"] == 0
    for pool in status["pools"].values():
        assert pool["in_use"] == 0 and pool["free"] + pool["cached"] == pool["capacity"], pool
    report = llm.engine.kv.audit(idle=True)
    assert report.ok, str(report)


def test_stream_joins_to_generate_text(tiny_gemma: LoadedModel, make_llm: MakeLLM) -> None:
    llm = make_llm(tiny_gemma)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    expected = llm.generate(["hello world"], params)[0].text
    pieces = list(llm.stream("hello world", params))
    assert len(pieces) >= 2 and "".join(pieces) == expected
    # a stop string across the first two pieces: held back, then cut the same way; nothing after it leaks
    stop = pieces[0][-1] + pieces[1][0]
    stopped = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop=(stop,))
    out = llm.generate(["hello world"], stopped)[0]
    assert out.finish_reason == "stop" and stop not in out.text
    assert "".join(llm.stream("hello world", stopped)) == out.text
    balanced_at_idle(llm)


def test_closing_a_stream_early_aborts_the_request(tiny_gemma: LoadedModel, make_llm: MakeLLM) -> None:
    llm = make_llm(tiny_gemma)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    stream = llm.stream("hello world", params)
    next(stream)
    stream.close()
    assert not any(not r.finished for r in llm.engine.requests.values())
    balanced_at_idle(llm)
    # the next call is unaffected
    assert "".join(llm.stream("hello world", SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)))
