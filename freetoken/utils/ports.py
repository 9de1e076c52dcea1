"""A free TCP port to listen on: for servers started as children (`ft chat --model`, `ft bench load`,
the benchmarks and the server tests). Owns nothing else."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing on `host` listens on now (the OS's choice; another process may take it
    before the caller binds it, which the callers' start-up checks report)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
