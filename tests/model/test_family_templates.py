"""The real chat templates of Qwen3.5, Qwen3-Coder, GLM-4.6 and Mistral Small 3.2 (as llama.cpp keeps
them in models/templates: Qwen3.5-4B.jinja, Qwen3-Coder.jinja, GLM-4.6.jinja,
Mistral-Small-3.2-24B-Instruct-2506.jinja) over tiny tokenizers with each family's marker tokens,
meeting the server's tool-call and reasoning handling.

Per family: the template chooses the tool parser (and the reasoning parser where it reasons); an
earlier call as the template renders it parses back to the same typed arguments; a generation in
the family's format, detokenized token by token as the server streams it, comes back as reasoning
and one typed call; `enable_thinking` reaches the template; the forced-call grammar accepts the
format and refuses anything else, markers that are special tokens (Mistral's) written by id.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import llguidance
import pytest
from tokenizers import AddedToken
from tokenizers import Tokenizer as Backend

from freetoken.engine.grammar import llg_tokenizer
from freetoken.request import SamplingParams
from freetoken.server.core.tool_calling import ToolCalling, ToolOptions
from freetoken.tokenizer.detokenizer import IncrementalDetokenizer
from freetoken.tokenizer.reasoning import detect_reasoning_parser
from freetoken.tokenizer.testing import write_tiny_tokenizer
from freetoken.tokenizer.tokenizer import Tokenizer
from freetoken.tokenizer.tool_parsers.registry import detect_tool_parser

HERE = Path(__file__).parent
PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "days": {"type": "integer"},
        "metric": {"type": "boolean"},
        "opts": {"type": "object"},
    },
    "required": ["city"],
}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": PARAMS}}
ARGS = {"city": "New York", "days": 3, "metric": True, "opts": {"hours": [6, 18]}}


@dataclass(frozen=True)
class Family:
    template: str
    plain: tuple[str, ...]  # added tokens that are not special
    special: tuple[str, ...]  # added special tokens
    parser: str
    reasoning: str | None
    output: str  # a generation calling get_weather(ARGS), after the generation prompt
    reasoning_text: str = ""


QWEN_CALL = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n<parameter=days>\n3\n</parameter>\n"
    '<parameter=metric>\nTrue\n</parameter>\n<parameter=opts>\n{"hours": [6, 18]}\n</parameter>\n</function>\n</tool_call>'
)
GLM_CALL = (
    "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>New York</arg_value>\n<arg_key>days</arg_key>\n"
    '<arg_value>3</arg_value>\n<arg_key>metric</arg_key>\n<arg_value>true</arg_value>\n<arg_key>opts</arg_key>\n'
    '<arg_value>{"hours": [6, 18]}</arg_value>\n</tool_call>'
)
FAMILIES = {
    # Qwen3.5's generation prompt opens `<think>\n`: the output starts inside the reasoning.
    "qwen3_5": Family(
        "qwen3_5_chat_template.jinja", ("<think>", "</think>", "<tool_call>", "</tool_call>"), (),
        "qwen3_coder", "think", f"I need the weather.\n</think>\n\n{QWEN_CALL}", "I need the weather.",
    ),
    "qwen3_coder": Family(
        "qwen3_coder_chat_template.jinja", ("<tool_call>", "</tool_call>"), (), "qwen3_coder", None, f"Checking.\n{QWEN_CALL}",
    ),
    "glm": Family(
        "glm4_6_chat_template.jinja",
        ("<think>", "</think>", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"),
        ("[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"),
        "glm45", "think", f"\n<think>I need the weather.</think>\n{GLM_CALL}", "I need the weather.",
    ),
    "mistral": Family(
        "mistral_small_3_2_chat_template.jinja", (),
        ("[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
         "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "[TOOL_RESULTS]", "[TOOL_CONTENT]", "[/TOOL_RESULTS]"),
        "mistral", None, '[TOOL_CALLS]get_weather[ARGS]{"city": "New York", "days": 3, "metric": true, "opts": {"hours": [6, 18]}}',
    ),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Family, Tokenizer]:
    fam = FAMILIES[request.param]
    directory = write_tiny_tokenizer(tmp_path_factory.mktemp(request.param), vocab_size=320)
    backend = Backend.from_file(str(directory / "tokenizer.json"))
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in fam.plain])
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in fam.special])
    backend.save(str(directory / "tokenizer.json"))
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["chat_template"] = (HERE / fam.template).read_text()
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return fam, Tokenizer.from_pretrained_dir(directory)


def calling(tokenizer: Tokenizer, options: ToolOptions, thinking: bool | None = None) -> ToolCalling:
    """The chat routes' output handling for this model, as the server builds it (auto-detected parsers)."""
    ctx: Any = SimpleNamespace(
        tokenizer=tokenizer,
        config=SimpleNamespace(tool_call_parser=None, reasoning_parser=None),
        client=SimpleNamespace(info=SimpleNamespace(architecture="unknown")),
    )
    return ToolCalling(ctx, options, thinking)


def specials(tokenizer: Tokenizer) -> list[str]:
    return [tokenizer.id_to_token(i) or "" for i in tokenizer.special_ids]


def test_the_template_chooses_the_parsers(family: tuple[Family, Tokenizer]) -> None:
    fam, tok = family
    assert detect_tool_parser(chat_template=tok.chat_template, special_tokens=specials(tok), architecture=None) == fam.parser
    assert detect_reasoning_parser(chat_template=tok.chat_template, tokens=specials(tok)) == fam.reasoning
    handling = calling(tok, ToolOptions(tools=(WEATHER,), choice="auto"))
    assert (handling.parser.name, handling.reasoning) == (fam.parser, fam.reasoning)


def test_an_earlier_call_as_rendered_parses_back(family: tuple[Family, Tokenizer]) -> None:
    _, tok = family
    call = {"id": "abcdefghi", "type": "function", "function": {"name": "get_weather", "arguments": ARGS}}
    messages = [
        {"role": "user", "content": "Weather in New York?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "abcdefghi", "content": "sunny"},
    ]
    text = tok.apply_chat_template(messages, tools=[WEATHER])
    handling = calling(tok, ToolOptions(tools=(WEATHER,), choice="auto"))
    parsed = handling.parser.parse(text)  # the whole prompt: the tool list's examples are no calls
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [("get_weather", ARGS)]


def test_a_streamed_generation_gives_reasoning_and_a_typed_call(family: tuple[Family, Tokenizer]) -> None:
    fam, tok = family
    handling = calling(tok, ToolOptions(tools=(WEATHER,), choice="auto"))
    params = handling.sampling(SamplingParams(max_tokens=64))
    ids = tok.encode(fam.output, add_special_tokens=False) + [tok.eos_id]  # the model stops on its end token
    assert len(ids) > 20  # really streamed in pieces
    # as the server decodes: special tokens kept where the format's markers are special, the end token hidden
    detok = IncrementalDetokenizer(tok, skip_special_tokens=params.skip_special_tokens, hidden_ids=tok.stop_ids)
    stream = handling.stream(incremental=True)
    deltas = [stream.feed(detok.add(i).text) for i in ids] + [stream.feed(detok.finish().text), stream.finish()]
    reasoning = "".join(d.reasoning for d in deltas)
    content = "".join(d.content for d in deltas)
    pieces = [d for delta in deltas for d in delta.tool_calls]
    assert pieces[0].first and pieces[0].call.name == "get_weather"
    assert len(pieces) > 3  # the name first, then the arguments in fragments
    assert reasoning == fam.reasoning_text
    assert content in ("", "Checking.")
    assert json.loads("".join(p.call.arguments for p in pieces)) == ARGS


@pytest.mark.parametrize("family", [name for name, f in FAMILIES.items() if f.reasoning is not None], indirect=True)
def test_enable_thinking_reaches_the_template(family: tuple[Family, Tokenizer]) -> None:
    fam, tok = family
    user = [{"role": "user", "content": "Hi"}]
    on, off = calling(tok, ToolOptions(), thinking=True), calling(tok, ToolOptions(), thinking=False)
    assert off.template_context() == {"enable_thinking": False}
    text_off = tok.apply_chat_template(user, extra_context=off.template_context())
    text_on = tok.apply_chat_template(user, extra_context=on.template_context())
    if fam.parser == "qwen3_coder":  # Qwen3.5 opens the reasoning in the prompt, or writes it closed and empty
        assert text_on.endswith("<|im_start|>assistant\n<think>\n") and on._opened
        assert text_off.endswith("<think>\n\n</think>\n\n") and not off._opened
    else:  # GLM: `/nothink` on the user turn and a closed, empty reasoning block
        assert text_on.endswith("<|assistant|>") and "/nothink" not in text_on
        assert text_off.endswith("Hi/nothink<|assistant|>\n<think></think>")


def test_forced_grammar_accepts_the_format_only(family: tuple[Family, Tokenizer]) -> None:
    fam, tok = family
    handling = calling(tok, ToolOptions(tools=(WEATHER,), choice="required"))
    params = handling.sampling(SamplingParams(max_tokens=64))
    assert params.grammar is not None and params.grammar[0] == "lark"
    grammar = params.grammar[1]
    canonical = handling.parser.format_calls(calling(tok, ToolOptions(tools=(WEATHER,), choice="auto")).parse(fam.output).tool_calls)
    wrong_type = canonical.replace("3", "three", 1) if fam.parser != "mistral" else canonical.replace(": 3", ': "3"')
    hermes = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    other_tool = canonical.replace("get_weather", "get_time")
    llt = llg_tokenizer(tok)
    for text, ok in [(canonical, True), (wrong_type, False), (hermes, False), (other_tool, False)]:
        matcher = llguidance.LLMatcher(llt, llguidance.LLMatcher.grammar_from_lark(grammar), log_level=0)
        ids = tok.encode(text, add_special_tokens=False)
        assert (all(matcher.consume_token(i) for i in ids) and matcher.is_accepting()) == ok, text
    if fam.parser == "mistral":  # the markers are special tokens: kept when decoding, named by id
        assert not params.skip_special_tokens
        assert f"<[{tok.token_to_id('[TOOL_CALLS]')}]>" in grammar and '"[TOOL_CALLS]"' not in grammar


@pytest.mark.parametrize("family", ["mistral"], indirect=True)
def test_mistral_renders_a_history_with_our_call_ids(family: tuple[Family, Tokenizer]) -> None:
    """Mistral's template refuses ids that are not 9 letters or digits; ours (`call_` + 24 hex) are
    handed to it as 9 hex digits of their hash, the same for the call and its result, so the template
    renders the history itself (not the text fallback)."""
    fam, tok = family
    call = {"id": "call_0123456789abcdef01234567", "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": "sunny"},
    ]
    handling = calling(tok, ToolOptions(tools=(WEATHER,), choice="auto"))
    text = tok.apply_chat_template(*handling.template_inputs(messages)[:1], tools=[WEATHER])
    short = handling.parser.template_call_id(call["id"])
    assert len(short) == 9 and short.isalnum() and handling.parser.template_call_id("abcdefghi") == "abcdefghi"
    assert f'[TOOL_CALLS]get_weather[CALL_ID]{short}[ARGS]{{"city": "Paris"}}' in text
    assert f"[TOOL_RESULTS]{short}[TOOL_CONTENT]sunny[/TOOL_RESULTS]" in text
