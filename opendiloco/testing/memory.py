"""Peers joined by in-memory pipes: the round runner's protocol without a DHT or p2p daemon."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from ..comm.rounds_taken import Rounds
from ..comm.wire import ByteStream, memory_pipe

Handler = Callable[[ByteStream], Awaitable[None]]


class MemoryNetwork:
    """Each peer has a handler for incoming streams (by default a ``Rounds`` registry's ``serve``)."""

    def __init__(self, wait_for_group: float = 2.0):
        self.wait_for_group = wait_for_group
        self.rounds: dict[str, Rounds] = {}
        self.handlers: dict[str, Handler] = {}
        self._tasks: set[asyncio.Task] = set()

    def add(self, peer: str, handler: Handler | None = None) -> Rounds:
        rounds = self.rounds[peer] = Rounds(wait_for_group=self.wait_for_group)
        self.handlers[peer] = handler or rounds.serve
        return rounds

    def connector(self, me: str) -> Callable[[str], Awaitable[ByteStream]]:
        async def connect(peer: str) -> ByteStream:
            if peer not in self.handlers:
                raise ConnectionRefusedError(f"no peer {peer}")
            mine, theirs = memory_pipe(me, peer)
            task = asyncio.create_task(self.handlers[peer](theirs))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            return mine

        return connect

    async def drain(self, timeout: float = 10.0) -> None:
        """Waits for every handler task to end (tests call it before checking what a handler saw)."""
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout)
