"""The `POST /v1/responses` request schema (pydantic) and its sampling checks.

Owns which top-level fields a Responses request may carry and what each means here: honoured
(`input`, `instructions`, `tools`, `tool_choice`, `parallel_tool_calls`, `text.format`,
`max_output_tokens`, `temperature`, `top_p`, `store`, `previous_response_id`, `stream`, `metadata`,
`user`, `reasoning.effort` as thinking on / off where the model has a reasoning parser, `include`'s
`reasoning.encrypted_content`, `message.output_text.logprobs` and `top_logprobs`), accepted and ignored because published clients send them
(`reasoning.summary`, the other `include` values,
`truncation`, `prompt_cache_key`, `client_metadata`, `service_tier`, `safety_identifier`,
`stream_options`, `max_tool_calls`, `context_management`, `prompt_cache_retention`,
`text.verbosity`, `priority`: sglang-router adds `priority: 0`), and refused with a 400 naming them (`background: true`, `conversation`,
`prompt`; checked as the body is parsed, with the simple ranges). Unknown fields are refused. Input items, tools and `text` are validated by
`items.py` and `tools.py`, which know their shapes; this module builds no
response bodies and knows nothing of the engine.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, model_validator

from freetoken.request import SamplingParams
from freetoken.server.errors import bad_request


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str
    input: str | list[Any] = []
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    stream: bool | None = False
    store: bool | None = None  # OpenAI's default is true: responses are kept unless store is false
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None  # echoed back
    user: str | None = None  # echoed back
    # accepted and ignored (docs/responses.md says why)
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    client_metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    stream_options: dict[str, Any] | None = None
    top_logprobs: int | None = None
    max_tool_calls: int | None = None
    context_management: list[Any] | None = None
    priority: int | None = None  # sglang-router adds it to every body it forwards (docs/scale-out.md)
    # refused when set
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    # FreeToken extensions (the Agents SDK passes them through `extra_args`)
    seed: int | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None

    @model_validator(mode="after")
    def check(self) -> ResponsesRequest:
        """The refused fields and the simple ranges (a 400 naming the field), as the body is
        parsed (an APIError, which pydantic passes through)."""
        if self.background:
            raise bad_request(
                "background responses are not supported by this server",
                param="background",
                code="unsupported_parameter",
            )
        for name in ("conversation", "prompt"):
            if getattr(self, name) is not None:
                raise bad_request(f"'{name}' is not supported by this server", param=name, code="unsupported_parameter")
        if self.max_output_tokens is not None and self.max_output_tokens < 1:
            raise bad_request(
                f"max_output_tokens must be at least 1, got {self.max_output_tokens}",
                param="max_output_tokens",
                code="invalid_value",
            )
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= 20:
            raise bad_request(
                f"top_logprobs must be in [0, 20], got {self.top_logprobs}", param="top_logprobs", code="invalid_value"
            )
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise bad_request(f"seed must be in [0, 2**63), got {self.seed}", param="seed", code="invalid_value")
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed when stream is true", param="stream_options")
        if self.previous_response_id is not None and not self.previous_response_id:
            raise bad_request("previous_response_id must not be empty", param="previous_response_id")
        return self

    def thinking(self) -> bool | None:
        """`reasoning.effort` as the template's `enable_thinking`: "none" is off, any other effort on,
        no effort the template's default (models without a reasoning parser ignore it)."""
        effort = (self.reasoning or {}).get("effort")
        if effort is not None and not isinstance(effort, str):
            raise bad_request("reasoning.effort must be a string", param="reasoning.effort")
        return None if effort is None else effort != "none"

    def logprobs_k(self) -> int | None:
        """The engine's `logprobs` (None = off; k = the chosen token and the top k): on with
        `include: ["message.output_text.logprobs"]` or `top_logprobs`."""
        if "message.output_text.logprobs" not in (self.include or []) and self.top_logprobs is None:
            return None
        return self.top_logprobs or 0

    @property
    def seals_reasoning(self) -> bool:
        """`include` asks for reasoning items to carry their text (`encrypted_content`)."""
        return "reasoning.encrypted_content" in (self.include or [])

    @property
    def stores(self) -> bool:
        return self.store is not False

    def sampling_params(self, max_tokens: int, grammar: tuple[str, str] | None) -> SamplingParams:
        """Range-checked SamplingParams (a 400 naming the field when one is out of range)."""
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            seed=self.seed,
            grammar=grammar,
            logprobs=self.logprobs_k(),
        )
        try:
            params.validate()
        except ValueError as err:
            name = str(err).split(" ", 1)[0]
            raise bad_request(str(err), param=name, code="invalid_value") from None
        return params
