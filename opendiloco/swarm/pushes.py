"""Matchmaking pushes on their own p2p protocol: a worker sends the peers that need them the records of
a round (announcements, groups) and rings their doorbell, so that a waiting peer looks at once instead
of at its next DHT read; it serves the pushes it is sent the same way (each record checked as one read
from the DHT, ``RunRecords.accept_pushed``). The records' wire form is ``pushed_records.py``'s."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable

from ..comm.wire import ByteStream, Code
from ..comm.wire import field as meta_field
from ..timeouts import PUSH_TIMEOUT_S
from .matchmaking import Doorbell
from .pushed_records import MAX_PUSH_BYTES, PushedRecord, decode_push, encode_push
from .records import RunRecords
from .streams import P2PStreams

log = logging.getLogger(__name__)


class Pushes:
    """Sends and serves pushes over ``streams``. ``in_background(coro)`` runs a coroutine on ``loop``
    (called there)."""

    def __init__(self, streams: P2PStreams, records: RunRecords, doorbell: Doorbell,
                 loop: asyncio.AbstractEventLoop, in_background: Callable):
        self.streams, self.records, self.doorbell = streams, records, doorbell
        self.loop, self.in_background = loop, in_background

    async def serve(self, stream: ByteStream) -> None:
        """A peer's push: its records are taken as the DHT's, and the doorbell of its key rings."""
        try:
            frame = await asyncio.wait_for(stream.recv(max_payload=MAX_PUSH_BYTES, expect=Code.GROUP),
                                           PUSH_TIMEOUT_S)
            key, attempt = meta_field(frame.meta, "key", str)[:64], meta_field(frame.meta, "attempt", int)
            if frame.payload:
                self.records.accept_pushed(decode_push(frame.payload))
            self.doorbell.ring(key, attempt)
        except Exception as e:  # a push is checked record by record; a bad one is dropped
            log.debug("dropped a matchmaking push from %s: %s", stream.remote[-8:], e)
        finally:
            stream.close()

    def push(self, peers: Iterable[str], key: str, attempt: int, pushed: list[PushedRecord]) -> None:
        """Called from the round thread: sends every peer these records and rings its doorbell, in the
        background (a peer that misses a push still finds the records in the DHT)."""
        payload = encode_push(pushed)

        async def push(peer: str) -> None:
            try:
                stream = await asyncio.wait_for(self.streams.connect(peer), PUSH_TIMEOUT_S)
                try:
                    await stream.send(Code.GROUP, {"key": key, "attempt": attempt}, payload)
                finally:
                    stream.close()
            except Exception as e:  # the peer still finds the records by reading the DHT
                log.debug("could not push to %s: %s", peer[-8:], e)

        def schedule() -> None:
            for peer in peers:
                self.in_background(push(peer))

        self.loop.call_soon_threadsafe(schedule)
