"""Negative controls of the mixed driver: for each rule it adds, a bug the audit alone misses.

Each bug of mixed_bugs.py is injected in turn. The driver's program is then played twice on a
seed of the fixed family: with only the audit (A1-A6 after every KV call and every step, the
engine's debug audit, and the idle audit) it must pass -- the bug keeps every count right -- and
with the whole driver (content oracle over the real K/V tensors, pin survival, no starvation,
outputs against the model's greedy continuation, idle state) it must fail, naming what caught
it. The seeds are tried in order until one shows the bug; one must within the first few.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from mixed_bugs import BUGS, Bug
from mixed_sim import run_mixed

CANDIDATE_SEEDS = range(12)  # the fixed family's seeds; each bug shows on at least one


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("bug", BUGS, ids=lambda b: b.name.replace(" ", "_"))
def test_bug_passes_the_audit_and_fails_the_driver(bug: Bug, monkeypatch: pytest.MonkeyPatch) -> None:
    bug.apply(monkeypatch)
    for seed in CANDIDATE_SEEDS:
        try:
            run_mixed(seed)
        except AssertionError as err:
            message = str(err)
            assert any(e in message for e in bug.expect), f"{bug.name}: seed {seed} failed for another reason:\n{message}"
            break
    else:
        pytest.fail(f"{bug.name} ({bug.rule}): no seed of {CANDIDATE_SEEDS} shows it")
    run_mixed(seed, oracle=False)  # the audit alone: passes with the bug in
