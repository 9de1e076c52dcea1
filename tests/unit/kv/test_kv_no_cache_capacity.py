"""A request that reads no cache (prompt logprobs) must fit twice in the FULL pool.

Found by the mixed driver (test_kv_mixed.py): such a request recomputes a cached prefix of its
prompt as its own pages, and its chunk commits attach its later pages beneath that prefix, which
is then tree-only but not a leaf, so eviction cannot take it while the request runs. With a
prompt of more than half the pool it ran out of pages at the same position on every resume,
preempted itself, and started again from token 0: the engine never drained. The engine now
refuses it up front (the resize floor already kept twice the largest request in flight).
"""

from __future__ import annotations

import pytest

from engine_sim import Setup, drain, make_engine, step, submit
from freetoken.engine.engine import RequestRefused

PROMPT = [1 + (i * 29) % 127 for i in range(39)]


def test_a_no_cache_request_over_half_the_pool_is_refused() -> None:
    engine = make_engine(Setup(4, None, 16))  # 64 tokens
    submit(engine, "a", PROMPT, 2)  # its prompt is now cached
    drain(engine)
    with pytest.raises(RequestRefused, match="prompt logprobs") as refused:
        submit(engine, "b", PROMPT, 12, prompt_logprobs=0)  # 51 tokens: 13 of 16 pages
    assert refused.value.code == "context_length_exceeded"
    submit(engine, "c", PROMPT, 12)  # the same request reading the cache is served
    drain(engine)


def test_a_no_cache_request_of_half_the_pool_over_its_cached_prompt_finishes() -> None:
    """Its own pages plus the cached prefix it duplicates fit, whatever it commits beneath it."""
    engine = make_engine(Setup(4, None, 16))
    prompt = PROMPT[:28]
    submit(engine, "a", prompt + [3, 4, 5], 2)  # a longer path, so b's commits go beneath it
    drain(engine)
    b = submit(engine, "b", prompt, 4, prompt_logprobs=0)  # 32 tokens: exactly half the pool
    for _ in range(400):
        if not engine.has_work():
            break
        step(engine)
    drain(engine)
    assert b.finished and len(b.output_ids) == 4
    assert b.prompt_logprobs is not None and len(b.prompt_logprobs) == len(prompt)
