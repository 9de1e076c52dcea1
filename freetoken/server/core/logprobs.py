"""Token logprobs as the OpenAI routes write them: `{token, logprob, bytes, top_logprobs}` items.

Owns `chat_logprobs`, shared by chat completions (`choices[].logprobs.content`) and Responses
(`output_text.logprobs`), which use the same item shape. The engine's entries are
`(token id, logprob, [(id, logprob), ...])`; a `None` entry (no logprob for that position) is
skipped. A logprob of minus infinity (a token a grammar or `logit_bias` ruled out, among the top
alternatives) is written as -9999.0, as OpenAI and vLLM write it: JSON has no infinity, and an
`-Infinity` literal breaks clients' parsers (and failed the non-streamed response).
"""

from __future__ import annotations

from typing import Any

from freetoken.tokenizer import Tokenizer


MIN_LOGPROB = -9999.0


def wire_logprob(logprob: float) -> float:
    """A logprob as JSON can carry it: minus infinity (and anything below) is MIN_LOGPROB."""
    return max(logprob, MIN_LOGPROB)


def chat_logprobs(tokenizer: Tokenizer, entries: list[Any]) -> list[dict[str, Any]]:
    """OpenAI's chat logprobs `content` items."""

    def item(token_id: int, logprob: float) -> dict[str, Any]:
        text = tokenizer.decode([token_id])
        return {"token": text, "logprob": wire_logprob(logprob), "bytes": list(text.encode("utf-8"))}

    out = []
    for entry in entries:
        if entry is None:
            continue
        top = entry[2] if len(entry) > 2 else []
        out.append({**item(entry[0], entry[1]), "top_logprobs": [item(t, lp) for t, lp in top]})
    return out
