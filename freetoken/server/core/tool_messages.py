"""Getting tools, earlier calls and tool results into a chat template that may not know them.

Owns `prepare_messages`: it probes what the model's template renders (a `tools` list, assistant
`tool_calls`, a `tool` role) by rendering tiny conversations, and for whatever it does not
render falls back to text in the parser's own format — the family's tool prompt in the system
message, earlier calls written as the model would write them, and tool results as user turns
(merged with neighbouring user turns, for templates that require alternation, like Gemma's).
Call arguments are handed to templates as objects, as Hugging Face templates expect. It renders
nothing else and never parses model output.
"""

from __future__ import annotations

import json
from typing import Any

from freetoken.tokenizer import ChatTemplateError, NoChatTemplate, Tokenizer
from freetoken.tokenizer.tool_parsers import ToolCall, ToolParser

_PROBE_TOOL = "ft_probe_tool_q7x"
_PROBE_RESULT = "ft_probe_result_k3w"


def _renders(
    tokenizer: Tokenizer, messages: list[dict[str, Any]], needle: str, tools: list[dict[str, Any]] | None = None
) -> bool:
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=tools)
    except (ChatTemplateError, NoChatTemplate):
        return False
    return needle in text


def _probe_call(call_id: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": _PROBE_TOOL, "arguments": {}}}


def template_support(tokenizer: Tokenizer, parser: ToolParser | None = None) -> tuple[bool, bool, bool]:
    """Whether the template renders (a tools list, assistant tool_calls, tool-role results), with
    call ids as `parser` hands them to templates."""
    probe_id = "call_probe" if parser is None else parser.template_call_id("call_probe")
    user = {"role": "user", "content": "hi"}
    tool = {
        "type": "function",
        "function": {"name": _PROBE_TOOL, "description": "probe", "parameters": {"type": "object"}},
    }
    tools = _renders(tokenizer, [user], _PROBE_TOOL, tools=[tool])
    calls = _renders(
        tokenizer, [user, {"role": "assistant", "content": "", "tool_calls": [_probe_call(probe_id)]}], _PROBE_TOOL
    )
    result = _renders(
        tokenizer,
        [
            user,
            {"role": "assistant", "content": "", "tool_calls": [_probe_call(probe_id)]},
            {"role": "tool", "tool_call_id": probe_id, "name": _PROBE_TOOL, "content": _PROBE_RESULT},
        ],
        _PROBE_RESULT,
    )
    return tools, calls, result


def _template_call(call: Any, parser: ToolParser) -> dict[str, Any]:
    """An OpenAI tool call with its arguments as an object where they parse, its id as the
    parser's templates take ids."""
    if not isinstance(call, dict):
        return {}
    fn = dict(call.get("function") or {})
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            fn["arguments"] = json.loads(args)
        except ValueError:
            pass
    out = {**call, "function": fn}
    if isinstance(call.get("id"), str):
        out["id"] = parser.template_call_id(call["id"])
    return out


def _as_tool_call(call: dict[str, Any]) -> ToolCall:
    fn = call.get("function") or {}
    args = fn.get("arguments", {})
    text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return ToolCall(str(call.get("id", "")), str(fn.get("name", "")), text)


def prepare_messages(
    tokenizer: Tokenizer,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]],
    parser: ToolParser,
    *,
    parallel: bool,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages and `tools` argument for `tokenizer`'s template (tools None when it does not
    render them and the tool prompt went into the system message instead)."""
    has_calls = any(m.get("tool_calls") for m in messages)
    has_results = any(m.get("role") == "tool" for m in messages)
    if not tools and not has_calls and not has_results:
        return messages, None
    renders_tools, renders_calls, renders_results = template_support(tokenizer, parser)
    names: dict[str, str] = {}
    out: list[dict[str, Any]] = []
    for message in messages:
        m = dict(message)
        calls = [_template_call(c, parser) for c in m.get("tool_calls") or []]
        if m.get("role") == "tool" and isinstance(m.get("tool_call_id"), str):
            m["tool_call_id"] = parser.template_call_id(m["tool_call_id"])
        for c in calls:
            names[str(c.get("id", ""))] = str((c.get("function") or {}).get("name", ""))
        if calls and renders_calls:
            m["tool_calls"] = calls
        elif calls:
            del m["tool_calls"]
            written = parser.format_calls([_as_tool_call(c) for c in calls])
            m["content"] = f"{m.get('content') or ''}\n{written}".lstrip("\n")
        if m.get("role") == "tool" and not renders_results:
            name = m.get("name") or names.get(str(m.get("tool_call_id", "")))
            m = {"role": "user", "content": parser.format_result(str(m.get("content") or ""), name)}
            if out and out[-1].get("role") == "user":
                out[-1] = {**out[-1], "content": f"{out[-1].get('content') or ''}\n{m['content']}"}
                continue
        elif m.get("role") == "user" and out and out[-1].get("role") == "user" and not renders_results and has_results:
            out[-1] = {**out[-1], "content": f"{out[-1].get('content') or ''}\n{m.get('content') or ''}"}
            continue
        out.append(m)
    if not tools:
        return out, None
    if renders_tools:
        return out, tools
    block = parser.tool_prompt(tools, parallel=parallel)
    if out and out[0].get("role") == "system":
        out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{block}".lstrip("\n")}
    else:
        out.insert(0, {"role": "system", "content": block})
    return out, None
