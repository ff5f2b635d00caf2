"""Relays for workers behind NAT: which peers carry their streams, and how a peer dials them there.

A worker in client mode accepts no inbound connection, so two such workers reach each other only
through a public peer that relays (libp2p's circuit relay v2). Such a worker reserves a slot on its
relays (its initial peers) and names them in its record (``WorkerRecord.relays``). Another worker in
client mode that opens a stream to it first connects through ``/p2p/RELAY/p2p-circuit`` (``dial_via``)
and keeps one idle "hold" stream open on that connection (``RelayLinks``). A public worker needs no
relay: it uses the connection the client-mode worker dialled out. libp2p keeps a relayed connection
end-to-end encrypted and authenticated: the relay forwards bytes it can neither read nor forge, and
the stream's remote peer id is still the worker's.

Measured in network namespaces behind masquerading routers (``tests/world/test_nat_relay.py``), with
hivemind 1.1.12's daemon:

- it finds relays by "discovery" and waits for 4 candidates, or 3 minutes, before it reserves a
  slot: a swarm of a few workers never has 4, and no slot was reserved in 3.5 minutes. With the
  relays given as static ones and discovery off it reserves at once, but ``P2P.create`` cannot turn
  discovery off, so the daemon's command line gets ``-relayDiscovery=0`` when relays are given;
- a public node relays only once libp2p believes it is publicly reachable, which AutoNAT decides
  from peers' dial-backs, if ever. A node not in client mode says it is reachable (that is what the
  setting means, and ``opendiloco doctor`` checks it), so the daemon is told so;
- libp2p announces a relayed address only for relays with public IP addresses, so peers in a network
  of private addresses (an office, a cloud VPC, the test world) never learn one: the record names
  the relays instead;
- hivemind's multiaddr library writes ``/p2p/ID`` in a form the daemon cannot read (a CID where it
  expects a bare multihash: "length greater than remaining number of bytes"), so circuit addresses
  are encoded here;
- a relayed connection is closed once it carries no stream: after one exchange, 22 of 24 later
  streams found no connection; with a hold stream open, none did;
- **a relayed connection carries at most 128 KiB in each direction** (the relay logs "relayed 131072
  bytes" and resets it): libp2p's default limit for relays, which this daemon applies whatever its
  ``-relayDataLimit`` says. A stream that crosses it fails. So a worker behind NAT owns no shard of a
  round (``comm.group.shard_bounds_for``): what two of them send each other is a few small frames;
- the limit is per connection, not per stream: a connection held across rounds ran out of it every
  7-8 rounds of the long scenario (about 17 KiB a round between two workers behind NAT), and that
  round failed for every member. So a held connection that carried a round is replaced by a fresh
  one when the next round starts (``RelayLinks.renew``), as is one older than ``RENEW_BEFORE_ROUND_S``
  (the relay also ends a relayed connection after 2 minutes).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Sequence

from hivemind.p2p import P2P, PeerID
from hivemind.utils.multiaddr import Multiaddr

from ...comm.wire import ByteStream
from ...timeouts import RELAY_DIAL_TIMEOUT as DIAL_TIMEOUT
from ..daemon import hivemind_privates
from ..daemon.dialing import dial_from_ephemeral_ports
from .addresses import connect_within

log = logging.getLogger(__name__)

MAX_RELAYS = 4
"""The most relays a record may name (a reader takes no more)."""
MAX_RELAY_CHARS = 256
MAX_HELD = 64
"""Relayed connections one worker keeps open (the oldest is let go beyond that)."""
MAX_HOLDS_PER_PEER = 2
MAX_HOLDS = 256
"""Hold streams a worker accepts from one peer, and in all (more are closed at once)."""

_P2P, _CIRCUIT = 421, 290  # multiaddr protocol codes of /p2p and /p2p-circuit


def daemon_options(client_mode: bool, relays: Sequence[str]) -> dict:
    """``P2P.create`` keyword arguments: a client-mode node reserves slots on ``usable_relays(relays)``
    (public peers' full addresses, with ``/p2p/ID``); any other node relays for the others. Either
    dials from ephemeral ports (``dialing.py``)."""
    dial_from_ephemeral_ports()
    if not client_mode:
        return {"force_reachability": "public"}
    relays = usable_relays(relays)
    options = {"force_reachability": "private", "use_auto_relay": bool(relays)}
    if relays:
        options["trusted_relays"] = list(relays)
    return options


def usable_relays(addresses: Sequence[str]) -> list[str]:
    """The first ``MAX_RELAYS`` addresses a record may name, one per peer: a worker started with more
    initial peers would otherwise publish a record every reader drops as malformed (and never be in
    a group), and several addresses of one peer would fill every slot with a single relay."""
    out, peers = [], set()
    for addr in addresses:
        peer = addr.rsplit("/p2p/", 1)[-1]
        if len(out) < MAX_RELAYS and peer not in peers and checked_relays([addr]):
            peers.add(peer)
            out.append(addr)
    return out


def checked_relays(value) -> tuple[str, ...] | None:
    """The relays a record names, or None if the field is malformed (input from the network)."""
    if not isinstance(value, (list, tuple)) or len(value) > MAX_RELAYS:
        return None
    out = []
    for addr in value:
        if not isinstance(addr, str) or len(addr) > MAX_RELAY_CHARS:
            return None
        try:
            circuit_address(addr)
        except ValueError:
            return None
        out.append(addr)
    return tuple(out)


class _Encoded:
    """A multiaddr as the daemon reads it (what ``ControlClient.connect`` asks of an address)."""

    def __init__(self, raw: bytes):
        self.raw = raw

    def to_bytes(self) -> bytes:
        return self.raw


def uvarint(n: int) -> bytes:
    """``n`` as an unsigned varint (multiaddr codes, protobuf)."""
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def circuit_address(relay: str) -> _Encoded:
    """``RELAY/p2p-circuit`` for a relay's full address (``.../p2p/ID``), encoded for the daemon."""
    base, sep, peer = relay.rpartition("/p2p/")
    if not sep or not base or "p2p-circuit" in base or "/" in peer:
        raise ValueError(f"not a relay's address with its peer id: {relay!r}")
    try:
        multihash, head = PeerID.from_base58(peer).to_bytes(), Multiaddr(base).to_bytes()
    except Exception as e:  # the multiaddr and base58 libraries' own errors
        raise ValueError(f"not a relay's address with its peer id: {relay!r} ({type(e).__name__})") from None
    return _Encoded(head + uvarint(_P2P) + uvarint(len(multihash)) + multihash + uvarint(_CIRCUIT))


class RelayBook:
    """The relays each peer's latest record names (filled by ``RunRecords`` as it reads records)."""

    def __init__(self):
        self._relays: dict[str, tuple[str, ...]] = {}
        self._lock = threading.Lock()

    def note(self, peer: str, relays: Sequence[str]) -> None:
        with self._lock:
            if relays:
                self._relays[peer] = tuple(relays)
            else:
                self._relays.pop(peer, None)

    def of(self, peer: str) -> tuple[str, ...]:
        with self._lock:
            return self._relays.get(peer, ())


async def dial_via(p2p: P2P, peer: str, relays: Sequence[str], timeout: float = DIAL_TIMEOUT) -> bool:
    """Connects to ``peer`` through its relays (at once if already connected); False if that failed,
    and the caller's direct dial says why."""
    failed = await connect_within(p2p, peer, lambda: [circuit_address(r) for r in relays], timeout)
    if failed is not None:
        log.debug("could not reach %s through its relays: %s: %s", peer[-8:], type(failed).__name__, failed)
    return failed is None


async def close_connections(p2p: P2P, peer: str) -> None:
    """Closes the node's connections to ``peer`` (best effort): the next stream or call dials anew."""
    try:
        await asyncio.wait_for(hivemind_privates.disconnect(p2p, PeerID.from_base58(peer)), DIAL_TIMEOUT)
    except asyncio.CancelledError:
        raise
    except Exception as e:  # gone already: the next stream dials anew either way
        log.debug("closing the connections to %s: %s: %s", peer[-8:], type(e).__name__, e)


class RelayLinks:
    """The relayed connections this worker (itself in client mode) keeps to peers behind NAT, one hold
    stream each.

    ``open_hold(peer)`` opens a hold stream (the caller's protocol, membership proof included); the
    peer's side (``serve_hold``) reads it until it ends. A hold ends when its connection dies, and the
    next ``ensure`` dials again."""

    def __init__(self, book: RelayBook, p2p: P2P, open_hold: Callable[[str], Awaitable[ByteStream]]):
        self.book, self.p2p, self.open_hold = book, p2p, open_hold
        self.me = p2p.peer_id.to_base58() if p2p is not None else ""
        self._held: dict[str, ByteStream] = {}
        self._since: dict[str, float] = {}
        """When each held connection was made (monotonic)."""
        self.renewed = 0
        """Held connections replaced so far (for status and tests)."""
        self._locks: dict[str, asyncio.Lock] = {}
        self._watchers: set[asyncio.Task] = set()
        self._serving: dict[str, int] = {}

    async def ensure(self, peer: str) -> None:
        """A connection to ``peer`` through its relays, kept open, if its record names relays (else nothing:
        the caller dials it directly)."""
        relays = self.book.of(peer)
        if not relays:
            return
        lock = self._locks.setdefault(peer, asyncio.Lock())
        async with lock:
            if peer in self._held:
                return
            if not await dial_via(self.p2p, peer, relays):
                return
            try:
                hold = await asyncio.wait_for(self.open_hold(peer), DIAL_TIMEOUT)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the stream that follows says what is wrong
                log.debug("could not hold a relayed connection to %s: %s: %s", peer[-8:], type(e).__name__, e)
                return
            self._held[peer] = hold
            self._since[peer] = time.monotonic()
            watcher = asyncio.create_task(self._watch(peer, hold))
            self._watchers.add(watcher)
            watcher.add_done_callback(self._watchers.discard)
            while len(self._held) > MAX_HELD:
                oldest = next(iter(self._held))
                self._held.pop(oldest).close()
                self._since.pop(oldest, None)

    async def renew(self, older_than: float = 0.0) -> None:
        """Replaces the held connections at least ``older_than`` seconds old with fresh ones: a relay limits
        what one relayed connection carries and how long it lives (above), not what a stream does. Of two
        workers behind NAT, the one with the smaller id renews their connection, so the two do not close
        each other's new one; the other's hold ends with the old one, and its next stream uses the new."""
        now = time.monotonic()
        due = [p for p, t in list(self._since.items()) if now - t >= older_than and self.me < p]
        await asyncio.gather(*(self._renew(p) for p in due))

    async def _renew(self, peer: str) -> None:
        lock = self._locks.setdefault(peer, asyncio.Lock())
        async with lock:
            hold = self._held.pop(peer, None)
            self._since.pop(peer, None)
            if hold is None:
                return
            hold.close()
            await close_connections(self.p2p, peer)
            self.renewed += 1
        await self.ensure(peer)

    async def _watch(self, peer: str, hold: ByteStream) -> None:
        try:
            await hold.recv(max_payload=0)  # nothing comes: this returns or raises when the hold ends
        except Exception:
            pass
        finally:
            hold.close()
            if self._held.get(peer) is hold:
                del self._held[peer]
                self._since.pop(peer, None)

    async def serve_hold(self, stream: ByteStream) -> None:
        """A peer's hold on its relayed connection to this worker: kept until it ends, bounded per peer."""
        peer = stream.remote
        if self._serving.get(peer, 0) >= MAX_HOLDS_PER_PEER or sum(self._serving.values()) >= MAX_HOLDS:
            stream.close()
            return
        self._serving[peer] = self._serving.get(peer, 0) + 1
        try:
            await stream.recv(max_payload=0)  # a hold carries nothing: any frame ends it
        except Exception:
            pass
        finally:
            stream.close()
            self._serving[peer] -= 1
            if not self._serving[peer]:
                del self._serving[peer]


def _static_relays_only(flags: dict) -> None:
    """A daemon given its relays (``trustedRelays`` with ``autoRelay``) looks for no others."""
    if flags.get("trustedRelays") and flags.get("autoRelay"):
        flags["relayDiscovery"] = False


hivemind_privates.edit_daemon_flags(_static_relays_only)
