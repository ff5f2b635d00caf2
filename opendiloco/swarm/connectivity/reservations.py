"""A worker behind NAT keeps its slots on its relays itself.

Another worker reaches one behind NAT only through a relay on which it holds a slot (a reservation,
libp2p's circuit relay v2). hivemind 1.1.12's daemon reserves slots at start (``relays``) but never
again on a relay that restarted: its relay finder backs a relay off for an hour after a reservation
with it failed (go-libp2p 0.32's ``autorelay`` default), and a relay forgets every slot when it stops
or when the reserving peer's connection to it closes. In the long scenario and ``bootkill.toml`` the
bootstrap, the NAT'd workers' only relay, was killed and started again: each of them stayed out of
reach of the other for the rest of the run.

So the worker asks each of its relays for a slot itself (``RelaySlots``), every ``RESERVE_EVERY_S`` (every
``RETRY_S`` while one gives none) and at once when its own address changed or it was cut off (its relays
dropped it then): one
``/libp2p/circuit/relay/0.2.0/hop`` stream with a RESERVE message, the relay's answer read and
bounded (``reserve``). A relay that already holds its slot extends it; one that restarted gives a new
one. The daemon's own stop handler takes the relayed connections that then come: a slot is a record
at the relay, whoever asked for it.

The same connection is how a worker behind NAT sees its router's address change, which nothing on its
own interfaces shows (``watch``). The router forgets its mappings then; the next packet on any of the
worker's connections leaves from the new address, and the peer answers it with a reset. So the worker
pings each relay every ``WATCH_EVERY_S`` (libp2p's ping, on the connection it holds): a connection that
broke that way, followed at once by a slot on a new one, is a move (``on_moved``). Before, the worker
took itself for cut off only after ``cut_off_after`` (15 s) of silence in a round, and its peers kept
their dead connections to it: in the long scenario one such move held all twelve workers 25 s.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import time
from collections.abc import Callable, Sequence

from hivemind.p2p import P2P, PeerID

from ...timeouts import OWN_CLOSE_GRACE_S, RESERVE_EVERY_S, RESERVE_TIMEOUT, SILENT_RELAY_S
from ...timeouts import RELAY_PING_TIMEOUT as PING_TIMEOUT
from ...timeouts import RELAY_WATCH_EVERY_S as WATCH_EVERY_S
from ...timeouts import RESERVE_AGAIN_S as AGAIN_S
from ...timeouts import RESERVE_RETRY_S as RETRY_S
from ..daemon import hivemind_privates
from .addresses import dial_addrs
from .relays import MAX_RELAYS, checked_relays, uvarint

log = logging.getLogger(__name__)

HOP_PROTOCOL = "/libp2p/circuit/relay/0.2.0/hop"
RESERVE = b"\x08\x00"
"""HopMessage{type: RESERVE} (protobuf: field 1, varint 0)."""
STATUS_FIELD, STATUS_OK = 5, 100
MAX_ANSWER_BYTES = 4096
"""The most a relay's answer may hold (a status, a reservation with a few addresses, a voucher)."""
PING_PROTOCOL = "/ipfs/ping/1.0.0"
PING_BYTES = 32


async def _read_varint(reader: asyncio.StreamReader) -> int:
    value = 0
    for shift in range(0, 64, 7):
        byte = (await reader.readexactly(1))[0]
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value
    raise ValueError("a varint longer than 64 bits")


def answer_status(message: bytes) -> int | None:
    """The ``status`` of a relay's HopMessage (protobuf), None if it has none; ``ValueError`` if the
    bytes are not a protobuf message (input from the network)."""
    i, status = 0, None
    while i < len(message):
        key, i = _take_varint(message, i)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _take_varint(message, i)
            if field == STATUS_FIELD:
                status = value
        elif wire == 2:
            length, i = _take_varint(message, i)
            if i + length > len(message):
                raise ValueError("a field runs past the message's end")
            i += length
        else:
            raise ValueError(f"wire type {wire} in a HopMessage")
    return status


def _take_varint(data: bytes, i: int) -> tuple[int, int]:
    value = 0
    for shift in range(0, 64, 7):
        if i >= len(data):
            raise ValueError("a varint runs past the message's end")
        byte = data[i]
        i += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, i
    raise ValueError("a varint longer than 64 bits")


async def reserve(p2p: P2P, relay: str, timeout: float = RESERVE_TIMEOUT) -> bool:
    """Asks the relay with peer id ``relay`` for a slot for this node; True if it gave one."""
    writer = None
    try:
        async def ask() -> bool:
            nonlocal writer
            reader, writer = await hivemind_privates.open_stream(p2p, PeerID.from_base58(relay), (HOP_PROTOCOL,))
            writer.write(uvarint(len(RESERVE)) + RESERVE)
            await writer.drain()
            length = await _read_varint(reader)
            if length > MAX_ANSWER_BYTES:
                raise ValueError(f"an answer of {length} bytes")
            return answer_status(await reader.readexactly(length)) == STATUS_OK

        return await asyncio.wait_for(ask(), timeout)
    except asyncio.CancelledError:
        raise
    except Exception as e:  # the relay is down, refused, or answered garbage: the next round tries again
        log.debug("reserving a slot on relay %s: %s: %s", relay[-8:], type(e).__name__, e)
        return False
    finally:
        if writer is not None:
            writer.close()


async def ping(p2p: P2P, peer: str, timeout: float = PING_TIMEOUT) -> bool | None:
    """libp2p's ping to ``peer``: True if it echoed, False if the stream failed (a connection reset, say),
    None if no answer came within ``timeout`` (a slow or cut-off link proves nothing)."""
    writer = None
    try:
        async def once() -> bool:
            nonlocal writer
            reader, writer = await hivemind_privates.open_stream(p2p, PeerID.from_base58(peer), (PING_PROTOCOL,))
            data = os.urandom(PING_BYTES)
            writer.write(data)
            await writer.drain()
            return await reader.readexactly(PING_BYTES) == data

        return await asyncio.wait_for(once(), timeout)
    except asyncio.CancelledError:
        raise
    except asyncio.TimeoutError:
        return None
    except Exception as e:
        log.debug("pinging %s: %s: %s", peer[-8:], type(e).__name__, e)
        return False
    finally:
        if writer is not None:
            writer.close()


def relay_ids(relays: Sequence[str]) -> list[str]:
    """The peer ids of relays given by their full addresses (``.../p2p/ID``)."""
    return [addr.rsplit("/p2p/", 1)[-1] for addr in relays if "/p2p/" in addr]


class RelaySlots:
    """Keeps this node's slots on its relays (``keep``, for ever: cancel to stop), asking every ``every``
    seconds, and at once after ``renew_soon`` (this worker's address changed: its relays dropped its
    connection, and with it its slot)."""

    def __init__(self, p2p: P2P, relays: Sequence[str], every: float = RESERVE_EVERY_S):
        self.p2p, self.every = p2p, every
        self.addresses: dict[str, str] = {relay_ids([a])[0]: a for a in relays if relay_ids([a])}
        """Each relay's full address (``.../p2p/ID``) by its peer id, as this worker's record names it."""
        self.adopted: set[str] = set()
        """The relays taken from the run (``adopt``), besides the initial ones."""
        self._soon = asyncio.Event()
        self.held: dict[str, bool] = {}
        """Whether each relay gave this node its slot the last time it was asked."""
        self.asked = 0
        """Times it asked its relays (for status and tests)."""
        self.on_slot_back: Callable[[str], None] | None = None
        """Called (on the loop) with a relay's id when it holds this node's slot again after giving none
        (it was down, or restarting): the other workers behind NAT on it are back within seconds too."""
        self.on_moved: Callable[[str], None] | None = None
        """Called (on the loop) with a relay's id when this node's connection to it broke and a new one
        holds its slot at once: its router's address changed (``watch``)."""
        self._own_close_at = -float("inf")
        self._silent_at: dict[str, float] = {}
        """When each relay last left a ping unanswered (``watch``)."""

    @property
    def relays(self) -> list[str]:
        """Its relays' peer ids, the initial ones first."""
        return list(self.addresses)

    def adopt(self, address: str) -> None:
        """A relay this node just got a slot on (a public worker of the run): kept and watched like the initial
        ones, and named in its record (``named``)."""
        relay = relay_ids([address])[0]
        if relay not in self.addresses:
            self.addresses[relay] = address
            self.adopted.add(relay)
            self.held[relay] = True

    def drop(self, relay: str) -> None:
        """Forgets an adopted relay (it left the run); the initial ones are kept whatever happens."""
        if relay in self.adopted:
            self.adopted.discard(relay)
            del self.addresses[relay]
            self.held.pop(relay, None)

    def named(self) -> tuple[str, ...]:
        """The full addresses of its relays, for its record."""
        return tuple(self.addresses.values())

    def renew_soon(self) -> None:
        """Asks the relays again now (call on the node's loop): this node closed its connections itself."""
        self._own_close_at = time.monotonic()
        self._soon.set()

    def closing(self, peers) -> None:
        """This node is about to close its connections to ``peers`` itself (a member given up on, a moved
        peer): if a relay is among them, its lost connection is no sign of a move."""
        if set(peers) & set(self.relays):
            self._own_close_at = time.monotonic()

    def closed_recently(self) -> bool:
        """Whether this node closed its connections itself (``renew_soon``) within ``OWN_CLOSE_GRACE_S``."""
        return time.monotonic() - self._own_close_at < OWN_CLOSE_GRACE_S

    async def watch(self, every: float = WATCH_EVERY_S) -> None:
        """Pings each relay every ``every`` seconds (for ever: cancel to stop). A connection to a relay
        that is gone or answers a ping with a failure lost this node's slot there: it asks for one at
        once, and if a new connection gives it one, calls ``on_moved``, unless this node had just closed
        its connections itself, or that relay left a ping unanswered within ``SILENT_RELAY_S`` (it froze
        and thawed: its own hiccup). Requiring every relay's connection to break (tried first) missed real
        moves: the daemon dialled some relays anew at once, and their pings echoed."""
        connected: set[str] = set()
        while True:
            await asyncio.sleep(every)
            try:
                now = {info.peer_id.to_base58() for info in await asyncio.wait_for(self.p2p.list_peers(), PING_TIMEOUT)}
            except Exception as e:  # asyncio.TimeoutError included: the daemon is busy; the next look tries again
                log.debug("listing this node's connections: %s: %s", type(e).__name__, e)
                continue
            pinged = [relay for relay in self.relays if relay in now]
            echoes = await asyncio.gather(*(ping(self.p2p, relay) for relay in pinged))
            looked_at = time.monotonic()
            for relay, echo in zip(pinged, echoes):
                if echo is None:  # no echo in time: the relay is frozen, or its link is
                    self._silent_at[relay] = looked_at
            lost = [relay for relay, echo in zip(pinged, echoes) if echo is False]
            lost += [relay for relay in self.relays if relay not in now and relay in connected]
            own = self.closed_recently()
            moved_to = None
            for relay in lost:
                ok = await reserve(self.p2p, relay)
                if not ok:  # the first ask may have gone out on the dying connection itself: once more
                    await asyncio.sleep(AGAIN_S)
                    ok = await reserve(self.p2p, relay)
                if ok:
                    now.add(relay)
                    self.held[relay] = True
                    # A relay that went silent before its connection broke froze (or its link did) and came
                    # back: its own hiccup. A move breaks connections that were echoing a moment before.
                    if looked_at - self._silent_at.get(relay, -float("inf")) > SILENT_RELAY_S:
                        moved_to = moved_to or relay
                else:
                    now.discard(relay)
                    self._soon.set()  # ``keep`` asks again from now on, every ``RETRY_S``
            if moved_to is not None and not own and self.on_moved is not None:
                self.on_moved(moved_to)
            connected = now & set(self.relays)

    async def keep(self) -> None:
        while True:
            relays = list(self.relays)  # relays are adopted and dropped meanwhile
            results = await asyncio.gather(*(reserve(self.p2p, relay) for relay in relays))
            for relay, ok in zip(relays, results):
                if relay not in self.relays:
                    continue
                if ok and self.held.get(relay) is False:
                    log.info("relay %s holds this worker's slot again: workers behind NAT reach it there", relay[-8:])
                    if self.on_slot_back is not None:
                        self.on_slot_back(relay)
                elif not ok and self.held.get(relay, True):
                    log.info("relay %s gives this worker no slot now (down, or refused): asked again every %.0f s",
                             relay[-8:], min(self.every, RETRY_S))
                self.held[relay] = ok
            self.asked += 1
            self._soon.clear()
            wait = self.every if all(results) else min(self.every, RETRY_S)
            try:
                await asyncio.wait_for(self._soon.wait(), wait)
            except asyncio.TimeoutError:
                pass


def relay_address(peer: str, addrs: Sequence[str]) -> str | None:
    """A public worker's full address for a record's relays (its first that is not loopback, where it has
    one), or None if no address of it makes one a reader would take."""
    ordered = sorted(addrs, key=lambda a: a.startswith(("/ip4/127.", "/ip6/::1/")))
    for addr in ordered:
        full = f"{addr}/p2p/{peer}"
        if checked_relays([full]):
            return full
    return None


async def widen(slots: RelaySlots, me: str, workers: dict) -> bool:
    """Holds slots on public workers of the run (``workers``: their records) until this node has
    ``MAX_RELAYS``, and forgets adopted ones that left the run; True if its relays changed (its record
    should name them). A worker behind NAT started with one initial peer holds one relay: when that peer
    is down, no other worker behind NAT can reach it (in the long world scenario, one of the two NAT'd
    workers was left out of every round while the bootstrap was down). Which public workers each picks
    is spread by its own id, so that no one of them carries every slot."""
    changed = False
    for relay in sorted(slots.adopted - set(workers)):
        slots.drop(relay)
        changed = True
    public = [p for p, r in workers.items() if p != me and p not in slots.relays and r.addrs and not r.relays
              and not r.left]
    public.sort(key=lambda p: hashlib.sha256(f"{me} {p}".encode()).digest())
    for peer in public:
        if len(slots.relays) >= MAX_RELAYS:
            break
        address = relay_address(peer, workers[peer].addrs)
        if address is None or not await dial_addrs(slots.p2p, peer, workers[peer].addrs):
            continue
        if await reserve(slots.p2p, peer):
            slots.adopt(address)
            changed = True
            log.info("holds a slot on %s too: workers behind NAT reach this worker there", peer[-8:])
    return changed
