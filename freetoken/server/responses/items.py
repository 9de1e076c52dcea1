"""Responses API items -> the chat messages a template renders.

Owns `items_to_messages`: `input` (a string, or a list of items) becomes chat messages —
`message` items (roles user / assistant / system / developer, the last rendered as system; text
parts `input_text`, `output_text`, `text`, `refusal`), `function_call` items (joined into the
assistant message before them as `tool_calls`), `function_call_output` items (`tool` messages,
named after their call), `reasoning` items (their text — `reasoning_text` parts, else an
`encrypted_content` this server sealed — handed to the next assistant message as
`reasoning_content`, which templates render or drop; other servers' tokens are dropped), and the items of hosted tools this server cannot run (dropped, and reported). The
same function reads a stored response's `output`, whose items are input items too. A wrong shape
is a 400 naming the exact key (`input[2].content[0].type`). Also `listed_items`, the items as
`GET /v1/responses/{id}/input_items` shows them. It renders and tokenizes nothing.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from freetoken.server.errors import bad_request
from freetoken.server.responses.reasoning import unseal

ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
TEXT_PARTS = {"input_text": "text", "output_text": "text", "text": "text", "refusal": "refusal"}
# Items of tools that run at OpenAI (or in a client this server cannot drive): left out of the prompt.
HOSTED_ITEMS = frozenset(
    {
        "web_search_call",
        "file_search_call",
        "computer_call",
        "computer_call_output",
        "code_interpreter_call",
        "image_generation_call",
        "local_shell_call",
        "local_shell_call_output",
        "shell_call",
        "shell_call_output",
        "apply_patch_call",
        "apply_patch_call_output",
        "custom_tool_call",
        "custom_tool_call_output",
        "mcp_call",
        "mcp_list_tools",
        "mcp_approval_request",
        "mcp_approval_response",
        "tool_search_call",
        "tool_search_output",
        "compaction",
        "compaction_trigger",
        "additional_tools",
        "program",
        "program_output",
    }
)

_ID_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


@dataclass
class Conversation:
    """Chat messages, plus the types of the hosted-tool items that were left out."""

    messages: list[dict[str, Any]] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)


def items_to_messages(
    value: str | list[Any], param: str = "input", *, names: dict[str, str] | None = None
) -> Conversation:
    """The chat messages of `input` (or a stored `output`). `names` maps earlier call ids to
    function names (for `function_call_output` items answering a call of an earlier turn)."""
    out = Conversation()
    if isinstance(value, str):
        out.messages.append({"role": "user", "content": value})
        return out
    call_names = dict(names or {})
    reasoning: list[str] = []  # reasoning waiting for the assistant message it came before
    for i, item in enumerate(value):
        where = f"{param}[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"{where} must be an object (an input item)", param=where)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            _add_message(out.messages, item, where)
        elif kind == "function_call":
            call = _function_call(item, where)
            call_names[call["id"]] = call["function"]["name"]
            last = out.messages[-1] if out.messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                out.messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id = _string(item, "call_id", where)
            message = {
                "role": "tool",
                "tool_call_id": call_id,
                "content": _output_text(item.get("output"), f"{where}.output"),
            }
            if call_id in call_names:
                message["name"] = call_names[call_id]
            out.messages.append(message)
        elif kind == "reasoning":
            text = _reasoning_text(item, where)
            if text:
                reasoning.append(text)
            continue
        elif kind in HOSTED_ITEMS:
            out.dropped.append(str(kind))
        elif kind == "item_reference":
            raise bad_request(
                f"{where}: item references are not supported; send the item itself", param=f"{where}.type"
            )
        else:
            raise bad_request(f"{where}.type: unknown input item type {kind!r}", param=f"{where}.type")
        if reasoning and kind in ("message", "function_call", "function_call_output"):
            last = out.messages[-1]
            if last["role"] == "assistant":  # reasoning before a user or tool turn belongs to no answer
                last.setdefault("reasoning_content", "\n".join(reasoning))
            reasoning = []
    return out


def _reasoning_text(item: dict[str, Any], where: str) -> str:
    """A reasoning item's text: its `reasoning_text` parts, else its sealed `encrypted_content`."""
    parts = item.get("content") or []
    if not isinstance(parts, list):
        raise bad_request(f"{where}.content must be a list of reasoning_text parts", param=f"{where}.content")
    texts = [p.get("text") for p in parts if isinstance(p, dict) and p.get("type") == "reasoning_text"]
    if any(not isinstance(t, str) for t in texts):
        raise bad_request(f"{where}.content: a reasoning_text part's text must be a string", param=f"{where}.content")
    if texts:
        return "\n".join(texts)  # type: ignore[arg-type]
    token = item.get("encrypted_content")
    if token is None:
        return ""
    if not isinstance(token, str):
        raise bad_request(f"{where}.encrypted_content must be a string", param=f"{where}.encrypted_content")
    return unseal(token, f"{where}.encrypted_content") or ""


def listed_items(value: str | list[Any]) -> list[dict[str, Any]]:
    """`input` as `GET /v1/responses/{id}/input_items` lists it: each item typed, with an id, and
    message content as parts (call after `items_to_messages` accepted it)."""
    if isinstance(value, str):
        value = [{"role": "user", "content": value}]
    out = []
    for item in value:
        kind = item.get("type", "message")
        listed = {**item, "type": kind}
        if kind == "message" and isinstance(item.get("content"), str):
            part = "output_text" if item.get("role") == "assistant" else "input_text"
            listed["content"] = [{"type": part, "text": item["content"]}]
        listed.setdefault("id", f"{_ID_PREFIX.get(kind, 'item')}_{uuid.uuid4().hex}")
        out.append(listed)
    return out


def call_names(messages: list[dict[str, Any]]) -> dict[str, str]:
    """Call id -> function name of every assistant tool call in `messages`."""
    return {c["id"]: c["function"]["name"] for m in messages for c in m.get("tool_calls") or []}


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise bad_request(f"{where}.{key} must be a string", param=f"{where}.{key}")
    return value


def _function_call(item: dict[str, Any], where: str) -> dict[str, Any]:
    call_id, name, arguments = (_string(item, k, where) for k in ("call_id", "name", "arguments"))
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _add_message(messages: list[dict[str, Any]], item: dict[str, Any], where: str) -> None:
    role = ROLES.get(item.get("role"))  # type: ignore[arg-type]
    if role is None:
        raise bad_request(
            f"{where}.role must be one of 'user', 'assistant', 'system', 'developer', got {item.get('role')!r}",
            param=f"{where}.role",
        )
    content = item.get("content")
    if isinstance(content, str):
        text = content
    elif isinstance(content, list):
        text = "\n".join(_part_text(part, f"{where}.content[{j}]") for j, part in enumerate(content))
    else:
        raise bad_request(f"{where}.content must be a string or a list of content parts", param=f"{where}.content")
    messages.append({"role": role, "content": text})


def _part_text(part: Any, where: str) -> str:
    if not isinstance(part, dict):
        raise bad_request(f"{where} must be a content part object", param=where)
    kind = part.get("type")
    key = TEXT_PARTS.get(kind)  # type: ignore[arg-type]
    if key is None:
        raise bad_request(
            f"{where}.type: content parts of type {kind!r} are not supported by this server (text only)",
            param=f"{where}.type",
            code="unsupported_content",
        )
    value = part.get(key)
    if not isinstance(value, str):
        raise bad_request(f"{where}.{key} must be a string", param=f"{where}.{key}")
    return value


def _output_text(value: Any, where: str) -> str:
    """A function call's `output`: a string, or a list of text parts."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "\n".join(_part_text(part, f"{where}[{j}]") for j, part in enumerate(value))
    raise bad_request(f"{where} must be a string or a list of content parts", param=where)
