"""A checkpoint's sampling defaults (generation_config.json, GGUF `general.sampling.*`) fill in the
fields a request leaves out, on every protocol; a field the request sets keeps its value;
`--sampling-defaults none` ignores them. Also chat's `reasoning_effort` as thinking on or off."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import anyio
import pytest

from freetoken.request import SamplingParams
from freetoken.server.anthropic.messages import message_input
from freetoken.server.anthropic.protocol import MessagesRequest
from freetoken.server.core.recipe import prepare_chat, prepare_prompts
from freetoken.server.openai.chat import chat_input
from freetoken.server.openai.completions import completion_input
from freetoken.server.openai.protocol import ChatCompletionRequest, CompletionRequest
from freetoken.server.openai.routes import model_card
from freetoken.server.sampling_defaults import left_out
from freetoken.server.serve import model_sampling_defaults
from freetoken.server.settings import ServerConfig
from freetoken.tokenizer import Tokenizer
from freetoken.tokenizer.testing import write_tiny_tokenizer
from freetoken.weights.sampling_defaults import SamplingDefaults, read_sampling_defaults

QWEN3_GENERATION_CONFIG = {"do_sample": True, "eos_token_id": [151645, 151643], "temperature": 0.6, "top_k": 20, "top_p": 0.95}
MESSAGES = [{"role": "user", "content": "hi"}]


def test_generation_config_gives_the_defaults(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps({**QWEN3_GENERATION_CONFIG, "min_p": 0, "presence_penalty": 1.5}))
    defaults = read_sampling_defaults(directory=tmp_path)
    assert defaults.values == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0, "presence_penalty": 1.5}
    assert defaults.source == "generation_config.json"
    assert defaults.describe() == "temperature 0.6, top_p 0.95, top_k 20, min_p 0, presence_penalty 1.5 (generation_config.json)"


def test_gguf_metadata_gives_the_defaults() -> None:
    meta = {"general.sampling.temp": 0.7, "general.sampling.top_k": 40, "general.sampling.penalty_repeat": 1.1,
            "general.sampling.mirostat": 0, "general.architecture": "llama"}
    assert read_sampling_defaults(metadata=meta).values == {"temperature": 0.7, "top_k": 40, "repetition_penalty": 1.1}


def test_missing_and_out_of_range_values_are_left_out(tmp_path: Path) -> None:
    assert read_sampling_defaults(directory=tmp_path) == SamplingDefaults()  # no generation_config.json
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": -1, "top_p": "high", "top_k": True, "min_p": 0.05}))
    assert read_sampling_defaults(directory=tmp_path).values == {"min_p": 0.05}
    assert read_sampling_defaults(metadata={"general.architecture": "gemma3"}) == SamplingDefaults()


def test_sampling_defaults_none_ignores_them(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps(QWEN3_GENERATION_CONFIG))
    started: Any = SimpleNamespace(metadata=None, source=SimpleNamespace(kind="safetensors", path=tmp_path))
    assert model_sampling_defaults(started, ServerConfig()).values["temperature"] == 0.6  # `model` is the default
    assert model_sampling_defaults(started, ServerConfig(sampling_defaults="none")) == SamplingDefaults()
    gguf: Any = SimpleNamespace(metadata={"general.sampling.top_p": 0.8}, source=SimpleNamespace(kind="gguf", path=None))
    assert model_sampling_defaults(gguf, ServerConfig()).values == {"top_p": 0.8}


def test_left_out_fields() -> None:
    chat = ChatCompletionRequest(model="m", messages=MESSAGES, temperature=0.0, top_k=5)
    assert left_out(chat) == {"top_p", "min_p", "repetition_penalty", "presence_penalty"}
    # Anthropic's request has no min_p / penalties: left out too
    anthropic = MessagesRequest(model="m", max_tokens=8, messages=MESSAGES, top_p=0.5)
    assert left_out(anthropic) == {"temperature", "top_k", "min_p", "repetition_penalty", "presence_penalty"}


def fake_ctx(tokenizer: Tokenizer, defaults: SamplingDefaults) -> Any:
    """What the recipe reads of a ServingContext: a ready engine, the tokenizer, the parsers' flags."""
    info = SimpleNamespace(context_length=512, vocab_size=tokenizer.vocab_size, architecture="llama")
    return SimpleNamespace(
        tokenizer=tokenizer,
        ready_info=lambda: info,
        check_capacity=lambda n: None,
        config=SimpleNamespace(tool_call_parser=None, reasoning_parser=None),
        client=SimpleNamespace(info=info),
        sampling_defaults=defaults,
        served_name="m",
    )


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.from_pretrained_dir(write_tiny_tokenizer(tmp_path_factory.mktemp("tok")))


DEFAULTS = SamplingDefaults({"temperature": 0.6, "top_k": 20, "top_p": 0.95, "presence_penalty": 1.5}, "generation_config.json")


def prepared(tokenizer: Tokenizer, defaults: SamplingDefaults, body: dict[str, Any], kind: str) -> SamplingParams:
    ctx = fake_ctx(tokenizer, defaults)
    if kind == "chat":
        return anyio.run(prepare_chat, ctx, chat_input(ChatCompletionRequest(model="m", messages=MESSAGES, **body))).params
    if kind == "messages":
        return anyio.run(prepare_chat, ctx, message_input(MessagesRequest(model="m", max_tokens=8, messages=MESSAGES, **body))).params
    return anyio.run(prepare_prompts, ctx, completion_input(CompletionRequest(model="m", prompt="hi", **body))).params


@pytest.mark.parametrize("kind", ["chat", "completions", "messages"])
def test_a_request_without_them_gets_the_checkpoints(tokenizer: Tokenizer, kind: str) -> None:
    params = prepared(tokenizer, DEFAULTS, {}, kind)
    assert (params.temperature, params.top_k, params.top_p, params.presence_penalty) == (0.6, 20, 0.95, 1.5)
    assert params.min_p == 0.0  # the checkpoint gives none: the API's default


@pytest.mark.parametrize("kind", ["chat", "completions", "messages"])
def test_a_request_that_sets_one_keeps_its_own(tokenizer: Tokenizer, kind: str) -> None:
    params = prepared(tokenizer, DEFAULTS, {"temperature": 0.0, "top_k": 3}, kind)
    assert (params.temperature, params.top_k, params.top_p) == (0.0, 3, 0.95)


def test_without_defaults_the_apis_own_apply(tokenizer: Tokenizer) -> None:
    params = prepared(tokenizer, SamplingDefaults(), {}, "chat")
    assert (params.temperature, params.top_k, params.top_p, params.presence_penalty) == (1.0, 0, 1.0, 0.0)


def test_the_model_card_shows_them(tokenizer: Tokenizer) -> None:
    assert model_card(fake_ctx(tokenizer, DEFAULTS), 0)["sampling_defaults"]["temperature"] == 0.6
    assert "sampling_defaults" not in model_card(fake_ctx(tokenizer, SamplingDefaults()), 0)


@pytest.mark.parametrize(("effort", "thinking"), [(None, None), ("none", False), ("minimal", True), ("high", True)])
def test_reasoning_effort_turns_thinking_on_or_off(effort: str | None, thinking: bool | None) -> None:
    extra = {} if effort is None else {"reasoning_effort": effort}
    assert chat_input(ChatCompletionRequest(model="m", messages=MESSAGES, **extra)).thinking is thinking


def test_a_response_echoes_the_temperature_it_sampled_with() -> None:
    from freetoken.server.responses.create import echo_fields
    from freetoken.server.responses.protocol import ResponsesRequest
    from freetoken.server.responses.tools import responses_tools

    tools = responses_tools(None, None, None)
    left = ResponsesRequest(model="m", input="hi")
    assert echo_fields(left, tools, DEFAULTS)["temperature"] == 0.6 and echo_fields(left, tools, DEFAULTS)["top_p"] == 0.95
    assert echo_fields(left, tools, SamplingDefaults())["temperature"] == 1.0
    assert echo_fields(ResponsesRequest(model="m", input="hi", temperature=0.2), tools, DEFAULTS)["temperature"] == 0.2
