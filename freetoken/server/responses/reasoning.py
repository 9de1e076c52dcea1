"""Reasoning handed back to the client and restored from it: the Responses `encrypted_content`.

Owns `seal` and `unseal`. Codex sends `store: false` with `include: ["reasoning.encrypted_content"]`
and replays the reasoning items of earlier turns; with nothing stored here, the item itself must
carry the reasoning. `seal` makes that token: `ft1.` + the URL-safe base64 of the text's UTF-8 —
encoded, not encrypted (anyone holding it can read it). `unseal` reads one back; a token that is
not this server's (OpenAI's own) is None, one of this server's that does not decode is a 400.
Nothing else here.
"""

from __future__ import annotations

import base64
import binascii

from freetoken.server.errors import bad_request

PREFIX = "ft1."


def seal(text: str) -> str:
    return PREFIX + base64.urlsafe_b64encode(text.encode("utf-8")).decode("ascii")


def unseal(token: str, param: str) -> str | None:
    """The reasoning text of `token`, or None when another server made it."""
    if not token.startswith(PREFIX):
        return None
    try:
        return base64.b64decode(token[len(PREFIX) :].encode("ascii"), altchars=b"-_", validate=True).decode("utf-8")
    except (binascii.Error, UnicodeError, ValueError):
        raise bad_request(f"{param} is not a reasoning token this server made", param=param) from None
