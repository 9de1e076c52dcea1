"""A request's reasoning budget: what it asks for (`ReasoningBudget`, a SamplingParams field) and
where the request stands against it (`ReasoningState`, advanced one output token at a time).

The rule: the reasoning opens with `start_ids` (or is open when generation starts, `start_ids`
empty) and the model may choose at most `max_tokens` tokens inside it. If those do not end with
`end_ids`, the engine writes `end_ids` itself as the next tokens — only its missing tail when the
model's last tokens already are a prefix of it. Reasoning the model closes on its own is left
alone, and once closed it stays closed: one budget per request, a later `start_ids` is ordinary
text. Forced tokens are ordinary output tokens (they count toward `SamplingParams.max_tokens`).

Owns that rule and nothing else: pure Python, no torch. The engine asks `forced()` before it
samples, feeds every output token to `advance`, and keeps drafts within `free_tokens()`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


@dataclass(frozen=True)
class ReasoningBudget:
    """At most `max_tokens` model-chosen tokens between `start_ids` and `end_ids` (0: close at
    once). Token sequences as tuples, so the params stay hashable; lists (the msgpack wire form)
    are turned into tuples."""

    max_tokens: int
    start_ids: tuple[int, ...] = ()  # empty: the reasoning is open when generation starts
    end_ids: tuple[int, ...] = ()  # must not be empty

    def __post_init__(self) -> None:
        object.__setattr__(self, "start_ids", tuple(self.start_ids))
        object.__setattr__(self, "end_ids", tuple(self.end_ids))

    def problem(self) -> str | None:
        """What is wrong with this budget, or None. The vocabulary bound is the engine's check."""
        if not _is_int(self.max_tokens) or self.max_tokens < 0:
            return "max_tokens must be an integer >= 0"
        if not self.end_ids:
            return "end_ids must not be empty"
        if not all(_is_int(t) and t >= 0 for t in self.start_ids + self.end_ids):
            return "start_ids and end_ids must be token ids >= 0"
        return None

    @classmethod
    def of(cls, value: ReasoningBudget | dict[str, object]) -> ReasoningBudget:
        """The budget itself, or one from its wire form (`dataclasses.asdict`, through msgpack)."""
        return value if isinstance(value, ReasoningBudget) else cls(**value)  # type: ignore[arg-type]


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class Phase(enum.Enum):
    OPENING = "opening"  # before start_ids
    REASONING = "reasoning"  # the model chooses; `spent` counts its tokens
    CLOSING = "closing"  # the budget is spent: the engine writes end_ids
    CLOSED = "closed"  # for the rest of the request


class ReasoningState:
    """One request's progress through its budget."""

    def __init__(self, budget: ReasoningBudget) -> None:
        self.budget = budget
        self.spent = 0  # model-chosen tokens inside the reasoning, end_ids it wrote itself included
        self._recent: list[int] = []  # the current phase's last tokens, as many as its marker has
        self._written = 0  # CLOSING: tokens of end_ids already out
        self.phase = Phase.OPENING
        if not budget.start_ids:
            self._open()

    def forced(self) -> int | None:
        """The token the next output token must be, or None when the model chooses."""
        return self.budget.end_ids[self._written] if self.phase is Phase.CLOSING else None

    def free_tokens(self) -> int | None:
        """How many next tokens the model surely chooses itself, whatever they are (None: all of
        them): a speculative draft stays within this, so no verified row would have been forced."""
        if self.phase is Phase.CLOSED:
            return None
        if self.phase is Phase.CLOSING:
            return 0
        if self.phase is Phase.REASONING:
            return self.budget.max_tokens - self.spent
        return 1 + self.budget.max_tokens  # the next token may complete start_ids

    def advance(self, token_id: int) -> None:
        """Account for one output token (sampled or forced)."""
        if self.phase is Phase.OPENING:
            if self._push(token_id, self.budget.start_ids):
                self._open()
        elif self.phase is Phase.REASONING:
            self.spent += 1
            if self._push(token_id, self.budget.end_ids):
                self.phase = Phase.CLOSED
            elif self.spent >= self.budget.max_tokens:
                self._close(_prefix_overlap(self._recent, self.budget.end_ids))
        elif self.phase is Phase.CLOSING:
            self._written += 1
            if self._written == len(self.budget.end_ids):
                self.phase = Phase.CLOSED

    def _push(self, token_id: int, marker: tuple[int, ...]) -> bool:
        """Remember `token_id`; True when the tokens now end with `marker`."""
        self._recent.append(token_id)
        del self._recent[: max(0, len(self._recent) - len(marker))]
        return tuple(self._recent) == marker

    def _open(self) -> None:
        self.phase = Phase.REASONING
        self._recent = []
        if self.budget.max_tokens == 0:
            self._close(0)

    def _close(self, written: int) -> None:
        self.phase = Phase.CLOSING
        self._written = written


def _prefix_overlap(tokens: list[int], marker: tuple[int, ...]) -> int:
    """The longest k < len(marker) with tokens[-k:] == marker[:k] (0 when none)."""
    for k in range(min(len(tokens), len(marker) - 1), 0, -1):
        if tuple(tokens[-k:]) == marker[:k]:
            return k
    return 0
