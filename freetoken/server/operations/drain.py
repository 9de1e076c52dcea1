"""Graceful drain: stop admitting, let in-flight requests finish, abort the rest, then exit.

Owns `DrainGate` (the admission gate every generation route passes: once draining, a new
request gets 503 with `Retry-After`; it also counts the generation requests being handled, so a
request still being parsed or tokenized is waited for like one the engine runs) and `drain`
(the sequence SIGTERM and `POST /admin/drain` start: wait until nothing is in flight or
`--shutdown-timeout` passed, end what is left with an error, then call `done`). It does not stop
the engine or the HTTP server itself: `done` (serve.py) does, and holds no other state.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from freetoken.server.errors import APIError

if TYPE_CHECKING:
    from freetoken.server.process.client import EngineClient

log = logging.getLogger("freetoken.server")

RETRY_AFTER_S = 30  # a draining server is going away: send clients elsewhere for a while
_POLL_S = 0.05


@dataclass
class DrainGate:
    draining: bool = False
    since: float | None = None  # time.monotonic() when the drain began
    handling: int = 0  # generation requests inside their route handler
    task: asyncio.Task[None] | None = field(default=None, repr=False)

    def check(self) -> None:
        """503 + Retry-After once draining."""
        if self.draining:
            raise APIError(
                503,
                "the server is shutting down (draining) and admits no new requests; retry on another server",
                code="server_draining",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )

    @contextmanager
    def admitted(self) -> Iterator[None]:
        """Check, then count the request as being handled until the block ends."""
        self.check()
        self.handling += 1
        try:
            yield
        finally:
            self.handling -= 1

    def begin(self, client: EngineClient, timeout_s: float, done: Callable[[], None], why: str) -> bool:
        """Start draining (on the running loop); False when a drain already runs."""
        if self.draining:
            return False
        self.draining = True
        self.since = time.monotonic()
        log.warning(
            "%s: draining (admitting nothing; in-flight requests get up to %g s, --shutdown-timeout)", why, timeout_s
        )
        self.task = asyncio.get_running_loop().create_task(drain(self, client, timeout_s, done), name="freetoken-drain")
        return True


async def drain(gate: DrainGate, client: EngineClient, timeout_s: float, done: Callable[[], None]) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while (gate.handling or client.num_in_flight) and loop.time() < deadline:
        await asyncio.sleep(_POLL_S)
    left = client.num_in_flight
    if left:
        client.abort_all(f"the server shut down (--shutdown-timeout {timeout_s:g} s passed while draining)")
        log.warning("drain: aborted %d request(s) still running after %g s", left, timeout_s)
    else:
        log.info("drain: every in-flight request finished")
    done()
