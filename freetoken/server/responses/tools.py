"""Responses API `tools`, `tool_choice` and `text.format` -> the core's tool options and grammar.

Owns the Responses shapes: function tools are flat (`{"type": "function", "name", "description",
"parameters", "strict"}`) and become the core's `ToolOptions`; tools of the hosted types
this server cannot run (`web_search`, `file_search`, `namespace`, `local_shell`, `custom`, `mcp`,
...) are left out of the prompt and reported (the route lists them in a response header), never
refused. `tool_choice` may be a mode, `{"type": "function", "name"}` or `{"type":
"allowed_tools", "mode", "tools"}`. `text.format` (`text` / `json_object` / flat `json_schema`)
becomes the engine grammar through `response_format.grammar_of`. Every 400 names the exact key.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from freetoken.server.core.response_format import grammar_of
from freetoken.server.core.tool_calling import CHOICES, ToolOptions, openai_tool_options
from freetoken.server.errors import bad_request

_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
_FUNCTION_KEYS = {
    "type",
    "name",
    "description",
    "parameters",
    "strict",
    "defer_loading",
    "allowed_callers",
    "output_schema",
    "async",
}
_SCHEMA_KEYS = {"type", "name", "schema", "strict", "description"}


@dataclass(frozen=True)
class ResponsesTools:
    options: ToolOptions
    ignored: tuple[str, ...]  # the hosted tool types left out, in request order, once each
    echo: tuple[dict[str, Any], ...]  # the function tools as the response body shows them


def responses_tools(tools: list[Any] | None, tool_choice: Any, parallel: bool | None) -> ResponsesTools:
    functions: list[dict[str, Any]] = []
    echo: list[dict[str, Any]] = []
    ignored: list[str] = []
    for k, tool in enumerate(tools or ()):
        where = f"tools[{k}]"
        if not isinstance(tool, dict) or not isinstance(tool.get("type"), str):
            raise bad_request(f"{where} must be an object with a 'type'", param=where)
        if tool["type"] != "function":
            if tool["type"] not in ignored:
                ignored.append(tool["type"])
            continue
        fn = _function(tool, where)
        functions.append({"type": "function", "function": fn})
        echo.append({"type": "function", "strict": tool.get("strict"), "parameters": None, "description": None, **fn})
    names = {t["function"]["name"] for t in functions}
    choice, functions = _choice(tool_choice, functions, names)
    return ResponsesTools(openai_tool_options(functions, choice, parallel), tuple(ignored), tuple(echo))


def _function(tool: dict[str, Any], where: str) -> dict[str, Any]:
    unknown = sorted(set(tool) - _FUNCTION_KEYS)
    if unknown:
        raise bad_request(f"{where}: unknown field {unknown[0]!r} of a function tool", param=f"{where}.{unknown[0]}")
    name = tool.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise bad_request(f"{where}.name must be 1-64 letters, digits, '_', '-' or '.'", param=f"{where}.name")
    description = tool.get("description")
    if description is not None and not isinstance(description, str):
        raise bad_request(f"{where}.description must be a string", param=f"{where}.description")
    parameters = tool.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise bad_request(f"{where}.parameters must be a JSON schema object", param=f"{where}.parameters")
    if tool.get("strict") is not None and not isinstance(tool.get("strict"), bool):
        raise bad_request(f"{where}.strict must be a boolean", param=f"{where}.strict")
    fn: dict[str, Any] = {"name": name}
    if description:
        fn["description"] = description
    fn["parameters"] = parameters if parameters is not None else {"type": "object", "properties": {}}
    return fn


def _choice(tool_choice: Any, functions: list[dict[str, Any]], names: set[str]) -> tuple[Any, list[dict[str, Any]]]:
    """The chat `tool_choice` and the function tools it leaves available."""
    if tool_choice is None or (isinstance(tool_choice, str) and tool_choice in CHOICES):
        return tool_choice, functions
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        name = tool_choice.get("name")
        if name not in names:
            raise bad_request(f"tool_choice.name: function {name!r} is not in tools", param="tool_choice.name")
        return {"type": "function", "function": {"name": name}}, functions
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "allowed_tools":
        mode = tool_choice.get("mode", "auto")
        if mode not in ("auto", "required"):
            raise bad_request(f"tool_choice.mode must be 'auto' or 'required', got {mode!r}", param="tool_choice.mode")
        allowed = tool_choice.get("tools")
        if not isinstance(allowed, list) or not all(isinstance(t, dict) for t in allowed):
            raise bad_request("tool_choice.tools must be a list of tool objects", param="tool_choice.tools")
        keep = {t.get("name") for t in allowed if t.get("type") == "function"}
        for name in keep:
            if name not in names:
                raise bad_request(f"tool_choice.tools: function {name!r} is not in tools", param="tool_choice.tools")
        return mode, [t for t in functions if t["function"]["name"] in keep]
    kind = tool_choice.get("type") if isinstance(tool_choice, dict) else tool_choice
    raise bad_request(
        f'tool_choice must be "auto", "none", "required", {{"type": "function", "name": ...}} or '
        f'{{"type": "allowed_tools", ...}}; {kind!r} names a tool this server cannot run',
        param="tool_choice",
    )


def text_grammar(text: dict[str, Any] | None) -> tuple[str, str] | None:
    """The engine grammar of `text.format` (None: plain text). `text.verbosity` is accepted."""
    if text is None:
        return None
    unknown = sorted(set(text) - {"format", "verbosity"})
    if unknown:
        raise bad_request(f"text: unknown field {unknown[0]!r}", param=f"text.{unknown[0]}")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise bad_request("text.format must be an object with a 'type'", param="text.format")
    kind = fmt.get("type")
    if kind in ("text", "json_object"):
        extra = set(fmt) - {"type"}
        if extra:
            raise bad_request(f"text.format: unknown field {min(extra)!r}", param=f"text.format.{min(extra)}")
        return grammar_of({"type": kind})
    if kind != "json_schema":
        raise bad_request(
            f"text.format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}", param="text.format.type"
        )
    unknown = sorted(set(fmt) - _SCHEMA_KEYS)
    if unknown:
        raise bad_request(f"text.format: unknown field {unknown[0]!r}", param=f"text.format.{unknown[0]}")
    if not isinstance(fmt.get("name"), str) or not fmt["name"]:
        raise bad_request("text.format.name must be a non-empty string", param="text.format.name")
    if not isinstance(fmt.get("schema"), dict):
        raise bad_request("text.format.schema must be a JSON schema object", param="text.format.schema")
    if fmt.get("strict") is not None and not isinstance(fmt["strict"], bool):
        raise bad_request("text.format.strict must be a boolean", param="text.format.strict")
    if fmt.get("description") is not None and not isinstance(fmt["description"], str):
        raise bad_request("text.format.description must be a string", param="text.format.description")
    spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if fmt.get(k) is not None}
    return grammar_of({"type": "json_schema", "json_schema": spec})
