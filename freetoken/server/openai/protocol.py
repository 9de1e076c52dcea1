"""The OpenAI request schemas (pydantic) and the checks that turn a request into SamplingParams.

Owns what a completions or chat request may contain: every accepted field with its type, the
fields current clients send that have no effect here (typed, then ignored: `store`, `metadata`,
`service_tier`, `prompt_cache_key`, `prompt_cache_retention`,
`prompt_cache_options`, `safety_identifier`, `verbosity`, `stream_options.include_obfuscation`,
`cache_control` / `prompt_cache_breakpoint` on a part; and the response-only keys a
client re-sends on an assistant message), the fields the server knows but does not implement
(each refused with a 400 that names it), and the range checks: `n`, `seed`, `stream_options`
and the refused fields as the body is parsed (a model validator, before the model name is
checked), `max_tokens`, `logprobs`, `messages` and `sampling_params()` (the sampling fields and
`logit_bias`) when the route translates the request, once. Types are strict (a string is not a
number, 0 is not a boolean) and unknown fields are refused. It does no tokenization and knows
nothing of the engine; responses are built as plain dicts by the route modules.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from freetoken.request import SamplingParams
from freetoken.server.core.limits import check_max_tokens
from freetoken.server.core.response_format import grammar_of
from freetoken.server.errors import bad_request

MAX_N = 16
MAX_STOP_STRINGS = 16


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool | None = False
    include_obfuscation: bool | None = None  # accepted and ignored: no obfuscation padding is sent


class _Sampling(_Strict):
    """Fields shared by both endpoints. `None` (JSON null) means the default."""

    model: str
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # extension: 0 or -1 = off
    min_p: float | None = None  # extension
    repetition_penalty: float | None = None  # extension
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    n: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # extension
    seed: int | None = None
    ignore_eos: bool | None = None  # extension
    speculative: bool | None = None  # extension: false opts out of --speculative ngram (docs/speculative.md)
    skip_special_tokens: bool | None = None  # extension
    user: str | None = None  # accepted and unused, as OpenAI documents it (an end-user id)
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias in [-100, 100]
    response_format: dict[str, Any] | None = None  # -> SamplingParams.grammar (response_format.py)
    # -- fields sglang-router and vllm-router add to every body they forward (docs/scale-out.md) --
    # `no_stop_trim` is honoured (true: a matched stop string stays at the end of the text); the
    # others are accepted at the value that describes what this server does (`router_defaults`),
    # any other value is a 400 naming the field.
    no_stop_trim: bool | None = None
    return_hidden_states: bool | None = None
    session_params: dict[str, Any] | None = None  # vllm-router keys affinity on `session_id`; ignored here

    def router_defaults(self) -> dict[str, bool]:
        return {"return_hidden_states": False}

    def refuse_router_values(self) -> None:
        for name, supported in self.router_defaults().items():
            value = getattr(self, name)
            if value is not None and value != supported:
                raise bad_request(
                    f"'{name}': {str(value).lower()} is not supported by this server (only {str(supported).lower()})",
                    param=name,
                    code="unsupported_parameter",
                )

    # -- end of the router fields --

    def unimplemented_fields(self) -> tuple[str, ...]:
        return ()

    def refuse_unimplemented(self) -> None:
        """A field the server knows but does not implement is a 400 that names it."""
        for name in self.unimplemented_fields():
            if getattr(self, name) is not None:
                raise bad_request(f"'{name}' is not supported by this server", param=name, code="unsupported_parameter")

    @property
    def num_choices(self) -> int:
        return 1 if self.n is None else self.n

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options is not None and self.stream_options.include_usage)

    def stop_strings(self) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise bad_request(f"stop: at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}", param="stop")
        return tuple(s for s in stops if s)

    @model_validator(mode="after")
    def check_common(self) -> _Sampling:
        """The checks every OpenAI route makes first, as the body is parsed (an APIError, which
        pydantic passes through)."""
        self.refuse_unimplemented()
        self.refuse_router_values()
        if not 1 <= self.num_choices <= MAX_N:
            raise bad_request(f"n must be in [1, {MAX_N}], got {self.n}", param="n")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise bad_request(f"seed must be in [0, 2**63), got {self.seed}", param="seed")
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed when stream is true", param="stream_options")
        return self

    def sampling_params(
        self,
        max_tokens: int,
        *,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
        vocab_size: int | None = None,
    ) -> SamplingParams:
        """Range-checked SamplingParams (a 400 naming the field when one is out of range);
        `logit_bias` ids are checked against `vocab_size` when it is given."""
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            frequency_penalty=0.0 if self.frequency_penalty is None else self.frequency_penalty,
            presence_penalty=0.0 if self.presence_penalty is None else self.presence_penalty,
            seed=self.seed,
            stop=self.stop_strings(),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=bool(self.ignore_eos),
            speculative=self.speculative is not False,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=True if self.skip_special_tokens is None else self.skip_special_tokens,
            grammar=grammar_of(self.response_format),
            logit_bias=logit_bias_pairs(self.logit_bias, vocab_size),
        )
        try:
            params.validate()
        except ValueError as err:
            name = str(err).split(" ", 1)[0]
            raise bad_request(str(err), param=name, code="invalid_value") from None
        return params


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    echo: bool | None = False
    logprobs: int | None = None
    suffix: str | None = None  # known, not implemented
    best_of: int | None = None  # known, not implemented

    def unimplemented_fields(self) -> tuple[str, ...]:
        return ("suffix", "best_of")

    def requested_max_tokens(self) -> int:
        """`max_tokens` (16 when null); a 400 below 1."""
        check_max_tokens(self.max_tokens)
        return 16 if self.max_tokens is None else self.max_tokens

    def checked_logprobs(self) -> int | None:
        """The legacy `logprobs` (None = off, k = the chosen token and the top k); a 400 outside [0, 20]."""
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise bad_request(f"logprobs must be in [0, 20], got {self.logprobs}", param="logprobs")
        return self.logprobs


class CacheControl(_Strict):
    """Anthropic-style `cache_control` some clients put on OpenAI parts: accepted and unused (the
    prefix cache is automatic)."""

    type: Literal["ephemeral"]
    ttl: str | None = None


class PromptCacheBreakpoint(_Strict):
    """OpenAI's explicit cache breakpoint on a part: accepted and unused (the cache is automatic)."""

    mode: Literal["explicit"]
    ttl: Literal["30m", "12h"] | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    prompt_cache_breakpoint: PromptCacheBreakpoint | None = None


class RefusalPart(_Strict):
    """An assistant's refusal, re-sent from an earlier response: rendered as its text."""

    type: Literal["refusal"]
    refusal: str


class UnsupportedPart(BaseModel):
    """A part type OpenAI defines that this server does not take; refused by name."""

    model_config = ConfigDict(extra="allow")
    type: Literal["image_url", "input_audio", "file"]


Part = Annotated[TextPart | RefusalPart | UnsupportedPart, Field(discriminator="type")]
Role = Literal["system", "developer", "user", "assistant", "tool"]


class FunctionCall(_Strict):
    """The deprecated single `function_call` of an earlier assistant turn."""

    name: str
    arguments: str


class ChatMessage(_Strict):
    role: Role
    content: str | list[Part] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # earlier assistant turns, rendered by the template
    function_call: FunctionCall | None = None  # earlier assistant turns of the deprecated API: a tool call
    reasoning_content: str | None = None  # earlier reasoning (vLLM's name), handed to the template
    reasoning: str | None = None  # the same, under the newer name
    # response-only keys a client re-sends with an assistant message (`message.model_dump()`): ignored
    refusal: str | None = None
    annotations: list[dict[str, Any]] | None = None
    audio: dict[str, Any] | None = None

    def text(self, where: str = "messages") -> str:
        """Text parts are joined with newlines (a refusal part counts as text)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        texts = []
        for j, part in enumerate(self.content):
            if isinstance(part, UnsupportedPart):
                param = f"{where}.content[{j}]"
                raise bad_request(
                    f"{param}: content parts of type '{part.type}' are not supported by this server", param=param
                )
            texts.append(part.text if isinstance(part, TextPart) else part.refusal)
        return "\n".join(texts)

    def for_template(self, where: str = "messages") -> dict[str, Any]:
        """The message as chat templates take it: `developer` is `system`, earlier reasoning is
        `reasoning_content` (templates that render it do; the others drop it)."""
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": self.text(where)}
        for key in ("name", "tool_call_id", "tool_calls"):
            value = getattr(self, key)
            if value is not None:
                out[key] = value
        if self.function_call is not None:
            call = {"id": "call_0", "type": "function", "function": self.function_call.model_dump()}
            out["tool_calls"] = [*out.get("tool_calls", []), call]
        reasoning = self.reasoning_content if self.reasoning_content is not None else self.reasoning
        if reasoning:
            out["reasoning_content"] = reasoning
        return out


class PromptCacheOptions(_Strict):
    """Accepted and unused: the prefix cache is automatic and keeps what fits."""

    mode: Literal["implicit", "explicit"] | None = None
    ttl: Literal["30m"] | None = None


_CHAT_UNIMPLEMENTED = ("functions", "function_call", "audio", "modalities", "prediction", "web_search_options")


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None  # checked by tool_calling.openai_tool_options
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    # known, not implemented; each is a 400 naming it when set
    functions: list[Any] | None = None
    function_call: Any = None
    audio: Any = None
    modalities: list[str] | None = None
    prediction: Any = None
    web_search_options: Any = None
    # accepted and ignored (docs/agents.md lists them): typed, so a wrong value is still a 400
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority", "fast"] | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None  # thinking()
    prompt_cache_key: str | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    prompt_cache_options: PromptCacheOptions | None = None
    safety_identifier: str | None = None
    verbosity: Literal["low", "medium", "high"] | None = None
    # -- router fields (see _Sampling): reasoning is split out by --reasoning-parser, always --
    continue_final_message: bool | None = None
    separate_reasoning: bool | None = None  # sglang-router
    stream_reasoning: bool | None = None  # sglang-router
    include_reasoning: bool | None = None  # vllm-router

    def router_defaults(self) -> dict[str, bool]:
        return {
            "return_hidden_states": False,
            "continue_final_message": False,
            "separate_reasoning": True,
            "stream_reasoning": True,
            "include_reasoning": True,
        }

    # -- end of the router fields --

    def check_messages(self) -> None:
        if not self.messages:
            raise bad_request("messages must not be empty", param="messages")

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.for_template(f"messages[{i}]") for i, m in enumerate(self.messages)]

    def unimplemented_fields(self) -> tuple[str, ...]:
        return _CHAT_UNIMPLEMENTED

    @property
    def max_param(self) -> str:
        """The name this request gave its output limit (errors name it)."""
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def requested_max_tokens(self) -> int | None:
        """`max_completion_tokens` or `max_tokens` (None: the rest of the context); a 400 when
        they disagree or below 1."""
        if (
            self.max_tokens is not None
            and self.max_completion_tokens is not None
            and self.max_tokens != self.max_completion_tokens
        ):
            raise bad_request("max_tokens and max_completion_tokens disagree; send one", param="max_completion_tokens")
        requested = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        check_max_tokens(requested, self.max_param)
        return requested

    def thinking(self) -> bool | None:
        """`reasoning_effort` as the template's `enable_thinking`: "none" is off, any other effort on,
        none given the template's default (models without a reasoning parser ignore it)."""
        return None if self.reasoning_effort is None else self.reasoning_effort != "none"

    def logprobs_k(self) -> int | None:
        """The engine's `logprobs` (None = off, k = the chosen token and the top k)."""
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", param="top_logprobs")
        if not self.logprobs:
            return None
        k = self.top_logprobs or 0
        if not 0 <= k <= 20:
            raise bad_request(f"top_logprobs must be in [0, 20], got {k}", param="top_logprobs")
        return k


MAX_LOGIT_BIAS = 100.0


def logit_bias_pairs(bias: dict[str, float] | None, vocab_size: int | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's `logit_bias` map as (token id, bias) pairs: keys are decimal token ids inside the
    vocabulary, values in [-100, 100]; a 400 names the key at fault."""
    pairs = []
    for key, value in (bias or {}).items():
        param = f"logit_bias.{key}"
        if not key.isdecimal():
            raise bad_request(f"logit_bias keys must be token ids, got {key!r}", param=param, code="invalid_value")
        token = int(key)
        if vocab_size is not None and token >= vocab_size:
            raise bad_request(
                f"logit_bias: token id {token} is outside the vocabulary (size {vocab_size})",
                param=param,
                code="invalid_value",
            )
        if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            raise bad_request(
                f"logit_bias values must be in [-100, 100], got {value} for {key}", param=param, code="invalid_value"
            )
        pairs.append((token, value))
    return tuple(pairs)
