"""The reasoning budget's state machine (freetoken/reasoning_budget.py), fed token by token as the
engine feeds it: which tokens it forces, when, how many the model chooses freely, and the budget's
validation and wire form."""

from __future__ import annotations

import dataclasses

import pytest

from freetoken.reasoning_budget import Phase, ReasoningBudget, ReasoningState
from freetoken.request import SamplingParams

END = (90, 91)
START = (80, 81)


def run(budget: ReasoningBudget, model: list[int]) -> list[int]:
    """The output when the model would write `model` (one token per step) and the state forces
    what it forces; a forced step consumes no model token."""
    state = ReasoningState(budget)
    out: list[int] = []
    tokens = iter(model)
    while True:
        tok = state.forced()
        if tok is None:
            tok = next(tokens, None)
            if tok is None:
                return out
        state.advance(tok)
        out.append(tok)


def test_open_at_start_forces_end_after_the_budget() -> None:
    assert run(ReasoningBudget(3, end_ids=END), [1, 2, 3, 4, 5]) == [1, 2, 3, 90, 91, 4, 5]


def test_budget_zero_closes_at_once() -> None:
    assert run(ReasoningBudget(0, end_ids=END), [1, 2]) == [90, 91, 1, 2]
    assert run(ReasoningBudget(0, START, END), [1, 80, 81, 2]) == [1, 80, 81, 90, 91, 2]


def test_the_count_starts_after_start_ids() -> None:
    model = [1, 2, 80, 81, 3, 4, 5, 6]
    assert run(ReasoningBudget(2, START, END), model) == [1, 2, 80, 81, 3, 4, 90, 91, 5, 6]


def test_start_ids_split_by_another_token_do_not_open() -> None:
    assert run(ReasoningBudget(1, START, END), [80, 1, 81, 2, 80, 80, 81, 3, 4]) == [80, 1, 81, 2, 80, 80, 81, 3, 90, 91, 4]


def test_a_close_the_model_writes_is_left_alone() -> None:
    model = [1, 90, 91, 2, 3, 4, 5, 6]  # closed within the budget of 4: nothing forced, ever
    assert run(ReasoningBudget(4, end_ids=END), model) == model
    model = [1, 2, 90, 91, 3, 4]  # the close ends exactly on the budget's last token
    assert run(ReasoningBudget(4, end_ids=END), model) == model


def test_a_later_start_does_not_reopen() -> None:
    model = [80, 81, 1, 90, 91, 80, 81, 2, 3, 4, 5]
    assert run(ReasoningBudget(3, START, END), model) == model


def test_a_started_close_is_completed_not_repeated() -> None:
    # the budget's last free token is end_ids[0]: only the rest of end_ids is forced
    assert run(ReasoningBudget(3, end_ids=END), [1, 2, 90, 5]) == [1, 2, 90, 91, 5]
    # a marker whose prefix repeats a token: (5, 5, 6) after ... 5, 5 needs only the 6
    assert run(ReasoningBudget(3, end_ids=(5, 5, 6)), [5, 5, 5, 1]) == [5, 5, 5, 6, 1]
    assert run(ReasoningBudget(2, end_ids=(5, 5, 6)), [1, 5, 2]) == [1, 5, 5, 6, 2]


def test_free_tokens_bound_every_forced_step() -> None:
    """`free_tokens` never promises a token that is then forced: for each step, the next
    `free_tokens()` steps are model-chosen."""
    for budget, model in [
        (ReasoningBudget(3, end_ids=END), [1, 2, 3, 4, 5, 6]),
        (ReasoningBudget(2, START, END), [80, 81, 1, 2, 3, 4, 5]),
        (ReasoningBudget(0, START, END), [80, 81, 1, 2]),
        (ReasoningBudget(4, end_ids=END), [1, 90, 91, 2, 3, 4, 5, 6]),
    ]:
        state = ReasoningState(budget)
        promises: list[int | None] = []
        forced: list[bool] = []
        tokens = iter(model)
        while (tok := state.forced()) is not None or (tok := next(tokens, None)) is not None:
            promises.append(state.free_tokens())
            forced.append(state.forced() is not None)
            state.advance(tok)
        for i, free in enumerate(promises):
            span = forced[i:] if free is None else forced[i : i + free]
            assert not any(span), (budget, i, free, forced)
        assert state.phase is Phase.CLOSED


def test_phases_and_spent() -> None:
    state = ReasoningState(ReasoningBudget(2, START, END))
    assert state.phase is Phase.OPENING and state.free_tokens() == 3
    for tok in (80, 81):
        state.advance(tok)
    assert state.phase is Phase.REASONING and state.free_tokens() == 2
    state.advance(1)
    state.advance(2)
    assert state.phase is Phase.CLOSING and state.spent == 2 and state.forced() == 90 and state.free_tokens() == 0
    state.advance(90)
    assert state.forced() == 91
    state.advance(91)
    assert state.phase is Phase.CLOSED and state.forced() is None and state.free_tokens() is None


@pytest.mark.parametrize(
    "budget,why",
    [
        (ReasoningBudget(-1, end_ids=END), "max_tokens"),
        (ReasoningBudget(True, end_ids=END), "max_tokens"),  # type: ignore[arg-type]
        (ReasoningBudget(4), "end_ids must not be empty"),
        (ReasoningBudget(4, (-3,), END), "token ids"),
        (ReasoningBudget(4, end_ids=(1, "x")), "token ids"),  # type: ignore[arg-type]
    ],
)
def test_bad_budgets_are_refused_by_validate(budget: ReasoningBudget, why: str) -> None:
    with pytest.raises(ValueError, match=rf"^reasoning_budget .*{why}"):
        SamplingParams(reasoning_budget=budget).validate()


def test_good_budgets_validate() -> None:
    SamplingParams(reasoning_budget=ReasoningBudget(0, end_ids=END)).validate()
    SamplingParams(reasoning_budget=ReasoningBudget(100, START, END)).validate()


def test_wire_form_comes_back_as_the_budget() -> None:
    """The API process sends `dataclasses.asdict(params)` with tuples as lists (msgpack); the
    engine process rebuilds SamplingParams from it, budget included, equal and hashable."""
    params = SamplingParams(max_tokens=9, reasoning_budget=ReasoningBudget(3, START, END))
    wire = {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(params).items()}
    assert wire["reasoning_budget"] == {"max_tokens": 3, "start_ids": (80, 81), "end_ids": (90, 91)}
    wire["reasoning_budget"] = {k: list(v) if isinstance(v, tuple) else v for k, v in wire["reasoning_budget"].items()}
    back = SamplingParams(**{k: tuple(v) if isinstance(v, list) else v for k, v in wire.items()})
    assert back == params and hash(back) == hash(params)
    assert isinstance(back.reasoning_budget, ReasoningBudget) and back.reasoning_budget.end_ids == END
