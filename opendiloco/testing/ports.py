"""A free TCP port, for a test or benchmark that must name one before a process binds it."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on ``host`` now (the OS picks it; another process may take it before use, so
    callers bind it at once)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
