"""What a request asks for and where it stands: SamplingParams, Request, FinishReason, outputs,
and the cache report.

Owns the per-request state the scheduler and sampler read and write (token ids, how many have
K/V written, finish reason) and `CacheReport`, the one value that says what the prefix cache and
speculative decoding did for a request, carried whole from the engine to the HTTP usage. It holds
no KV pages itself: the KV manager owns the page tables.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from freetoken.reasoning_budget import ReasoningBudget, ReasoningState

if TYPE_CHECKING:  # the API process imports this module and must not pay for torch
    import torch


class FinishReason(str, enum.Enum):
    STOP = "stop"  # an EOS / stop token id / stop string
    LENGTH = "length"  # max_tokens or the context length
    ABORT = "abort"  # the client went away or asked to stop
    ERROR = "error"  # the engine could not serve it (quarantined pages, a refused request)


# What a `SamplingParams.grammar` may be: (kind, text). `json_schema`: the schema as JSON text;
# `json_object`: any JSON object (text ignored, send ""); `lark`: a Lark grammar (llguidance's
# dialect); `regex`: a regular expression the whole output must match. A tuple of two strings,
# so it travels through msgpack as a list and comes back unchanged.
GRAMMAR_KINDS = ("json_schema", "json_object", "lark", "regex")


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop. `temperature == 0` is greedy."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None = off; k >= 0: the chosen token's logprob and the top k
    prompt_logprobs: int | None = None  # such requests skip the prefix cache
    skip_special_tokens: bool = True
    # Constrained decoding: (kind, text) with kind in GRAMMAR_KINDS, enforced by the engine (its
    # `grammar` module); the request finishes ("stop") once the grammar is complete.
    grammar: tuple[str, str] | None = None
    # (token id, bias) pairs added to the logits before any other transformation (OpenAI's
    # `logit_bias`); the API process checks the ids against the vocabulary.
    logit_bias: tuple[tuple[int, float], ...] = ()
    # Speculative decoding (`--speculative ngram`, engine/speculative.py) applies to this request
    # when the engine has it on; False opts out (the `speculative` extension field of the API).
    speculative: bool = True
    # At most this many tokens inside the model's reasoning, then the engine writes its close
    # (freetoken/reasoning_budget.py); None: no budget.
    reasoning_budget: ReasoningBudget | None = None

    def __post_init__(self) -> None:
        # The wire form (msgpack) turns the pairs into lists and the budget into a dict; the
        # params stay hashable tuples and dataclasses.
        object.__setattr__(self, "logit_bias", tuple((int(t), float(b)) for t, b in self.logit_bias))
        if self.reasoning_budget is not None:
            object.__setattr__(self, "reasoning_budget", ReasoningBudget.of(self.reasoning_budget))

    def validate(self) -> None:
        """Raise ValueError naming the first parameter that is out of range."""
        budget_problem = None if self.reasoning_budget is None else self.reasoning_budget.problem()
        checks: list[tuple[str, bool, str]] = [
            ("max_tokens", self.max_tokens >= 1, "must be at least 1"),
            (
                "temperature",
                0.0 <= self.temperature <= 100.0 and math.isfinite(self.temperature),
                "must be in [0, 100]",
            ),
            ("top_p", 0.0 < self.top_p <= 1.0, "must be in (0, 1]"),
            ("top_k", self.top_k >= 0 or self.top_k == -1, "must be -1, 0 (off) or positive"),
            ("min_p", 0.0 <= self.min_p <= 1.0, "must be in [0, 1]"),
            ("repetition_penalty", 0.0 < self.repetition_penalty <= 10.0, "must be in (0, 10]"),
            ("frequency_penalty", -2.0 <= self.frequency_penalty <= 2.0, "must be in [-2, 2]"),
            ("presence_penalty", -2.0 <= self.presence_penalty <= 2.0, "must be in [-2, 2]"),
            ("logprobs", self.logprobs is None or 0 <= self.logprobs <= 20, "must be in [0, 20]"),
            ("prompt_logprobs", self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20, "must be in [0, 20]"),
            ("grammar", _valid_grammar(self.grammar), f"must be None or (kind, text) with kind in {GRAMMAR_KINDS}"),
            (
                "logit_bias",
                all(t >= 0 and -100.0 <= b <= 100.0 for t, b in self.logit_bias),
                "must be (id >= 0, bias in [-100, 100]) pairs",
            ),
            ("reasoning_budget", budget_problem is None, str(budget_problem)),
        ]
        for name, ok, why in checks:
            if not ok:
                raise ValueError(f"{name} {why}, got {getattr(self, name)!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _valid_grammar(grammar: object) -> bool:
    if grammar is None:
        return True
    return (
        isinstance(grammar, tuple) and len(grammar) == 2 and grammar[0] in GRAMMAR_KINDS and isinstance(grammar[1], str)
    )


@dataclass
class TokenLogprob:
    """The chosen token's logprob and the top alternatives (id, logprob), best first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass(frozen=True)
class CacheReport:
    """What the prefix cache and speculative decoding did for one request: its hit at its first
    admission (and, where the hit fell short, why), what its pins keep, and its verified drafts.
    A request's report only grows; each change makes a new one (`dataclasses.replace`)."""

    cached_tokens: int = 0  # prefix-cache hit at (first) admission
    matched_tokens: int = 0  # whole pages of the prompt the prefix cache held then (kv/miss.py)
    miss_reason: str | None = None  # why the hit stopped there; None: no prefix cache used
    cache_creation_tokens: int = 0  # prompt tokens past the hit that the request's pins keep
    drafted_tokens: int = 0  # speculative decoding, over the request so far: tokens drafted and verified
    accepted_tokens: int = 0  # ... of which the verification accepted

    def after(self, later: CacheReport) -> CacheReport:
        """This report brought up to `later`, a later report of the same request. The counts only
        grow, so each keeps its largest, and the miss is the latest one stated: an update that
        carries no report (an end the engine reported outside a step) changes nothing."""
        stated = later if later.miss_reason is not None else self
        return CacheReport(
            max(self.cached_tokens, later.cached_tokens),
            stated.matched_tokens,
            stated.miss_reason,
            max(self.cache_creation_tokens, later.cache_creation_tokens),
            max(self.drafted_tokens, later.drafted_tokens),
            max(self.accepted_tokens, later.accepted_tokens),
        )


@dataclass
class Request:
    """One sequence being served. `num_computed` tokens of `all_ids` have K/V written."""

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    eos_ids: frozenset[int] = frozenset()
    boundaries: tuple[int, ...] = ()  # marked token offsets (end of each chat message)
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    report: CacheReport = CacheReport()  # set at (first) admission, grown by pins and verified drafts
    pins: tuple[tuple[int, float], ...] = ()  # retention pins: (prompt position, TTL seconds), ascending
    pins_done: int = 0  # pins already applied (each once, when its prefix is committed)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    error: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)
    generator: torch.Generator | None = None  # the request's own, when it has a seed
    admitted_once: bool = False
    preemptions: int = 0
    reasoning: ReasoningState | None = None  # set by the engine when params.reasoning_budget is

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """`all_ids[start:end]` without building prompt + output (a decode step reads one id)."""
        n = len(self.prompt_ids)
        if start >= n:
            return self.output_ids[start - n : end - n]
        if end <= n:
            return self.prompt_ids[start:end]
        return self.prompt_ids[start:] + self.output_ids[: end - n]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def in_prefill(self) -> bool:
        """True while tokens other than the last sampled one still wait for their K/V."""
        return self.num_computed < self.num_tokens - 1 or not self.output_ids

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED


@dataclass
class RequestOutput:
    """What the offline API returns per prompt."""

    rid: str
    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    cached_tokens: int
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    error: str | None = None
    drafted_tokens: int = 0  # speculative decoding: tokens drafted and verified
    accepted_tokens: int = 0  # ... of which the verification accepted
