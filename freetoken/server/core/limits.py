"""The length checks every generation route makes before it queues anything.

Owns `check_max_tokens` (a requested output length below 1 is a 400 naming the field) and
`check_context` (prompt + output past the model's context is a 400 `context_length_exceeded`
naming the field to lower, never clamped). Each route passes its own field names.
"""

from __future__ import annotations

from freetoken.server.errors import APIError, bad_request


def check_max_tokens(max_tokens: int | None, param: str = "max_tokens") -> None:
    if max_tokens is not None and max_tokens < 1:
        raise bad_request(f"{param} must be at least 1, got {max_tokens}", param=param, code="invalid_value")


def check_context(prompt_len: int, max_tokens: int, context_length: int, *, prompt_param: str, max_param: str) -> None:
    """Prompt + max_tokens past the context is a 400 `context_length_exceeded`, never clamped."""
    if prompt_len >= context_length:
        raise APIError(
            400,
            f"this model's context length is {context_length} tokens; the prompt has {prompt_len}",
            param=prompt_param,
            code="context_length_exceeded",
        )
    if prompt_len + max_tokens > context_length:
        raise APIError(
            400,
            f"this model's context length is {context_length} tokens; the request asks for {prompt_len} prompt "
            f"+ {max_tokens} completion tokens; lower {max_param}",
            param=max_param,
            code="context_length_exceeded",
        )
