"""Connection reversal: a public worker that cannot dial a worker behind NAT asks it, through its relay,
to dial back.

A worker behind NAT (client mode) accepts no inbound connection, so a public peer reaches it only on a
connection the NAT'd worker dialled out. When there is none and the NAT'd worker's own dials fail, the
two stay apart. The long scenario showed why its dials fail after the peer is back: libp2p's dialler
backs off an address whose dial failed (5 s, then 5 s + n² s after the n-th failure, at most 5
minutes), so a NAT'd worker that dialled a public peer during its freeze, a partition or a restart
refused to dial it for 30 s to 2 minutes after it was back, and every attempt that held both failed.
Nothing the NAT'd worker can do lifts that backoff; a new connection from the peer does (libp2p
clears a peer's backoff on any connection to it), and only the relay can carry one.

So a public worker whose stream to a NAT'd one finds no way to dial it (``ConnectionReversal.ask``):

1. connects to it through the relays its record names (``relays.dial_via``): the NAT'd worker's
   daemon then clears its backoff for this worker;
2. asks it, on that connection, to dial back (``Code.REVERSE``);
3. waits for the direct connection it dials, and opens its stream on that one.

The NAT'd worker (``serve``) answers, closes the relayed connection (its daemon would take it for a
connection to the peer and not dial) and dials the asker directly, at the addresses the asker's record
names and those its daemon knows. A relayed connection carries little (``relays``): the round's
streams go on the direct one.

A request makes the NAT'd worker dial the asker and nobody else (the dial authenticates the peer id),
at most once per ``MIN_INTERVAL_S`` for each asker and ``MAX_PER_MINUTE`` times a minute in all.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time

from hivemind.p2p import P2P

from ...comm.wire import ByteStream, Code
from ...timeouts import REVERSAL_ANSWER_TIMEOUT as ANSWER_TIMEOUT
from ...timeouts import REVERSAL_DIRECT_WAIT_S as DIRECT_WAIT_S
from ...timeouts import REVERSAL_MIN_INTERVAL_S as MIN_INTERVAL_S
from ...timeouts import REVERSAL_RELAY_DIAL_TIMEOUT as RELAY_DIAL_TIMEOUT
from .addresses import AddressBook, dial_addrs
from .relays import RelayBook, close_connections, dial_via

log = logging.getLogger(__name__)

MAX_PER_MINUTE = 30
"""The most requests a NAT'd worker serves in a minute, from all askers together."""
MAX_PEERS = 1024
"""Peers whose last reversal is remembered (the oldest is forgotten first)."""


async def direct_connection(p2p: P2P, peer: str) -> bool:
    """Whether this node holds a connection to ``peer`` that is not relayed."""
    try:
        infos = await asyncio.wait_for(p2p.list_peers(), ANSWER_TIMEOUT)
    except asyncio.CancelledError:
        raise
    except Exception:  # the daemon did not answer: no connection this caller can count on
        return False
    return any(info.peer_id.to_base58() == peer and not any("p2p-circuit" in str(a) for a in info.addrs)
               for info in infos)


class ConnectionReversal:
    """Asks workers behind NAT to dial this one back (a public worker), or serves such asks (one behind NAT).

    ``streams`` opens and serves the request's protocol (``streams.P2PStreams``, membership proof included)."""

    def __init__(self, p2p: P2P, streams, relay_book: RelayBook, address_book: AddressBook):
        self.p2p, self.streams = p2p, streams
        self.relay_book, self.address_book = relay_book, address_book
        self._last: collections.OrderedDict[str, float] = collections.OrderedDict()
        """When a reversal with each peer last began (monotonic)."""
        self._locks: dict[str, asyncio.Lock] = {}
        self._served: collections.deque[float] = collections.deque()
        self.reversed = 0
        """Direct connections a NAT'd peer dialled back after this worker asked (for status and tests)."""
        self.served = 0
        """Requests this worker accepted (behind NAT)."""
        self.dialled = 0
        """Askers this worker dialled back (behind NAT)."""

    def _due(self, peer: str) -> bool:
        """Whether a reversal with ``peer`` may begin now (and notes that one does)."""
        now = time.monotonic()
        if now - self._last.get(peer, -MIN_INTERVAL_S) < MIN_INTERVAL_S:
            return False
        self._last.pop(peer, None)
        self._last[peer] = now
        while len(self._last) > MAX_PEERS:
            self._last.popitem(last=False)
        return True

    async def ask(self, peer: str) -> bool:
        """Has ``peer`` (behind NAT: its record names relays) dial this worker; True once a direct connection
        from it is there. False at once for a peer whose record names no relay, or one asked less than
        ``MIN_INTERVAL_S`` ago that has not dialled back."""
        relays = self.relay_book.of(peer)
        if not relays:
            return False
        if len(self._locks) > MAX_PEERS:
            self._locks = {p: lock for p, lock in self._locks.items() if lock.locked()}
        async with self._locks.setdefault(peer, asyncio.Lock()):
            if await direct_connection(self.p2p, peer):  # another stream's request got one meanwhile
                return True
            if not self._due(peer) or not await dial_via(self.p2p, peer, relays, RELAY_DIAL_TIMEOUT):
                return False
            try:
                stream = await asyncio.wait_for(self.streams.connect(peer), ANSWER_TIMEOUT)
                try:
                    await stream.send(Code.REVERSE, {})
                    await asyncio.wait_for(stream.recv(max_payload=0, expect=Code.REVERSE), ANSWER_TIMEOUT)
                finally:
                    stream.close()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the relayed connection may be closed before the answer arrives
                log.debug("asking %s to dial back: %s: %s", peer[-8:], type(e).__name__, e)
            deadline = time.monotonic() + DIRECT_WAIT_S
            while time.monotonic() < deadline:
                if await direct_connection(self.p2p, peer):
                    self.reversed += 1
                    log.info("%s (behind NAT) could not be dialled: it dialled this worker back, asked through "
                             "its relay", peer[-8:])
                    return True
                await asyncio.sleep(0.1)
            return False

    async def serve(self, stream: ByteStream) -> None:
        """A public peer asks this worker (behind NAT) to dial it back."""
        peer = stream.remote
        now = time.monotonic()
        while self._served and now - self._served[0] > 60.0:
            self._served.popleft()
        try:
            if len(self._served) >= MAX_PER_MINUTE or not self._due(peer):
                await stream.refuse("asked to dial back too often")
                return
            self._served.append(now)
            self.served += 1
            await asyncio.wait_for(stream.recv(max_payload=0, expect=Code.REVERSE), ANSWER_TIMEOUT)
            await stream.send(Code.REVERSE, {})
        except Exception as e:  # garbage or silence: nothing is dialled
            log.debug("a request to dial back from %s: %s: %s", peer[-8:], type(e).__name__, e)
            return
        finally:
            stream.close()
        await asyncio.sleep(0.2)  # the answer leaves before its connection is closed
        await close_connections(self.p2p, peer)  # the relayed one: while it is there, the daemon would not dial
        if await dial_addrs(self.p2p, peer, self.address_book.of(peer)):
            self.dialled += 1
            log.info("dialled %s back, as it asked through this worker's relay", peer[-8:])
