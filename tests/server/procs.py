"""Helpers for tests that run real engine processes: a module-wide event loop runner, child
process listing, a bounded poll, and a freezer that keeps a respawned engine from starting."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import psutil

T = TypeVar("T")


class LoopRunner:
    """One event loop shared by the tests of a module (an EngineClient lives on one loop)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()

    def run(self, coro: Awaitable[T]) -> T:
        return self.loop.run_until_complete(coro)  # type: ignore[arg-type]

    def close(self) -> None:
        self.loop.close()


def engine_children() -> list[psutil.Process]:
    """Live child processes of this one, except multiprocessing's resource tracker (one per
    interpreter, started with the first spawn and ended at its exit)."""
    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() == psutil.STATUS_ZOMBIE or "resource_tracker" in " ".join(child.cmdline()):
                continue
        except psutil.NoSuchProcess:
            continue
        found.append(child)
    return found


async def poll_until(check: Callable[[], Awaitable[bool]], deadline_s: float, interval_s: float = 0.05) -> bool:
    """Await `check()` until it is true or `deadline_s` passed (a generous bound, not a timing claim)."""
    end = time.monotonic() + deadline_s
    while True:
        if await check():
            return True
        if time.monotonic() > end:
            return False
        await asyncio.sleep(interval_s)


class RespawnFreezer(threading.Thread):
    """Suspends (SIGSTOP) the first new child process of `parent_pid`: the engine a server's
    supervisor spawns after a death, caught while it still imports torch, long before it can say
    Ready, so the server stays down until `resume()`."""

    def __init__(self, parent_pid: int) -> None:
        super().__init__(daemon=True)
        self.parent = psutil.Process(parent_pid)
        self.known = {c.pid for c in self.parent.children(recursive=True)}  # old engine, resource tracker
        self.frozen: psutil.Process | None = None
        self.caught = threading.Event()
        self.quit = threading.Event()

    def run(self) -> None:
        while not self.quit.is_set():
            for child in self.parent.children(recursive=True):
                if child.pid not in self.known:
                    child.suspend()
                    self.frozen = child
                    self.caught.set()
                    return
            time.sleep(0.001)

    def resume(self) -> None:
        self.quit.set()
        if self.frozen is not None:
            self.frozen.resume()
