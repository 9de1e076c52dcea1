"""Request state: the token views the scheduler and runner read."""

from __future__ import annotations

from freetoken.request import Request, SamplingParams


def test_token_slice_equals_slicing_all_ids() -> None:
    r = Request("r", [1, 2, 3, 4], SamplingParams(), output_ids=[5, 6, 7])
    for start in range(8):
        for end in range(start, 8):
            assert r.token_slice(start, end) == r.all_ids[start:end]
