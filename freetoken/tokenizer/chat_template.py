"""Chat templates: rendering a list of messages into a prompt string with jinja2.

Owns the sandboxed jinja2 environment chat templates run in (set up the way Hugging Face
transformers sets it up, so a model's template renders the same text), the typed errors of
rendering, and the lookup of the built-in template used when a model ships none (a family's
`chat_template`, families/: Gemma 3's, as the bundled Gemma is a base model without a template).
It does not tokenize and does not parse model output.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from freetoken.errors import FreeTokenError
from freetoken.families import named


class NoChatTemplate(FreeTokenError):
    """The model has no chat template and none is built in for its architecture."""


class ChatTemplateError(FreeTokenError):
    """A chat template failed to compile or refused the conversation (its `raise_exception`)."""


def builtin_chat_template(architecture: str) -> str | None:
    """The template used for `architecture` (GGUF `general.architecture`, HF `model_type` or
    `ModelConfig.architecture`) when the model ships none: its family's `chat_template`, or None."""
    fam = named(architecture)
    return None if fam is None else fam.chat_template


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (marks assistant text for training masks in HF);
    here it renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: jinja2.runtime.Macro) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: object,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Unlike jinja2's own filter: no HTML escaping, and the json.dumps options templates use.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class ChatTemplate:
    """One compiled chat template."""

    def __init__(self, source: str) -> None:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(source)
        except jinja2.exceptions.TemplateError as err:
            raise ChatTemplateError(f"the chat template does not compile: {err}") from None
        self.source = source

    def render(
        self,
        messages: Sequence[Mapping[str, object]],
        *,
        add_generation_prompt: bool,
        tools: Sequence[Mapping[str, object]] | None = None,
        bos_token: str = "",
        eos_token: str = "",
        extra_context: Mapping[str, object] | None = None,
    ) -> str:
        """The prompt text. `extra_context` adds template variables (e.g. `enable_thinking`); the
        named arguments win over it."""
        context: dict[str, object] = dict(extra_context or {})
        context.update(
            messages=[dict(m) for m in messages],
            add_generation_prompt=add_generation_prompt,
            tools=None if tools is None else [dict(t) for t in tools],
            bos_token=bos_token,
            eos_token=eos_token,
        )
        try:
            return self._template.render(context)
        except jinja2.exceptions.TemplateError as err:
            raise ChatTemplateError(f"the chat template refused the conversation: {err}") from None
