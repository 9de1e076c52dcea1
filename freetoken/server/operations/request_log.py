"""One log line per generation request, when it ends.

Owns the line's content and wording: route, HTTP status, request id, prompt / cached / generated
tokens, time to the first token, decode speed (generated tokens after the first over the time
since it came) and the finish reason(s); for a request refused before it ran (400, 404, 429,
503, ...), the route, status, id and the error's message. `--log-format json` gets the same numbers as fields
(`extra`). The logger is `freetoken.requests` (a log filter can silence it). It is called from
core/streaming.py's `record`, which every route's request passes through as it ends, and from
core/endpoint.py for a refusal.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

log = logging.getLogger("freetoken.requests")


@dataclass(frozen=True)
class RequestEnd:
    route: str  # the metrics' endpoint name: chat, completions, responses, messages
    status: int
    request_id: str
    prompt_tokens: int
    cached_tokens: int
    generated_tokens: int
    ttft_s: float | None  # None: no token came
    decode_s: float | None  # from the first token to the end
    finish_reasons: Sequence[str | None]  # per choice (None: the choice did not finish)
    error: str | None = None  # refused before it ran (4xx, 503): the error's message

    @property
    def tokens_per_s(self) -> float | None:
        """Decode speed: the tokens after the first, over the time since the first came."""
        if self.decode_s is None or self.decode_s <= 0 or self.generated_tokens < 2:
            return None
        return (self.generated_tokens - 1) / self.decode_s

    @property
    def finish(self) -> str:
        reasons = [r or "none" for r in self.finish_reasons]
        if not reasons:
            return "none"
        return reasons[0] if len(set(reasons)) == 1 else ",".join(reasons)

    def line(self) -> str:
        ttft = "-" if self.ttft_s is None else f"{self.ttft_s:.3f}s"
        speed = "-" if self.tokens_per_s is None else f"{self.tokens_per_s:.1f}"
        if self.error is not None:
            return f"{self.route} {self.status} id={self.request_id} error={self.error!r}"
        return (
            f"{self.route} {self.status} id={self.request_id} prompt={self.prompt_tokens} cached={self.cached_tokens} "
            f"generated={self.generated_tokens} ttft={ttft} tok/s={speed} finish={self.finish}"
        )

    def fields(self) -> dict[str, object]:
        return {
            "event": "request",
            "route": self.route,
            "status": self.status,
            "request_id": self.request_id,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "generated_tokens": self.generated_tokens,
            "ttft_s": None if self.ttft_s is None else round(self.ttft_s, 4),
            "tokens_per_s": None if self.tokens_per_s is None else round(self.tokens_per_s, 2),
            "finish_reason": self.finish,
            **({} if self.error is None else {"error": self.error}),
        }


def log_request(end: RequestEnd) -> None:
    log.info(end.line(), extra=end.fields())


def log_refused(route: str, status: int, request_id: str, message: str) -> None:
    """A request answered with an error before it ran (its one line)."""
    log_request(RequestEnd(route, status, request_id, 0, 0, 0, None, None, (), message))
