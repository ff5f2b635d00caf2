"""A worker's watch over its own connectivity: its address changes, its router moves, its peers move.

Connections through an address that is gone are dead, and a stream on one hangs until a transport
timeout (39-58 s in the world scenario). So whenever this worker learns that its own address changed
(its daemon's listen addresses, ``Presence.on_new_address``), that its router's did (behind NAT: its
connection to a relay broke and came back, ``RelaySlots.on_moved``, or its DHT node lost every peer and
found them again, ``Presence.on_rejoined``), or that a peer's did (its record says so,
``RunRecords.on_peers_moved``), it closes the connections concerned so that the next stream dials anew,
and abandons an attempt in flight (its record says so, and the members stop waiting on it). Behind NAT
it also keeps its relay slots (``reservations.py``) and widens them to the run's public workers.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import Callable

from hivemind.p2p import P2P

from ...comm.runner import RoundRunner
from ...timeouts import FROZEN_PING_TIMEOUT_S as PING_TIMEOUT_S
from ...timeouts import RELAY_DIAL_TIMEOUT as DIAL_TIMEOUT
from ...timeouts import WIDEN_EVERY_S
from ..exclusion import UnreachablePeers
from ..presence import Presence
from ..records import RunRecords
from ..run_snapshot import RunSnapshot
from .addresses import dial_addrs
from .relays import close_connections
from .reservations import RelaySlots, ping, widen

log = logging.getLogger(__name__)


class ConnectivityWatch:
    """Hears of moves (this worker's, its router's, its peers') and closes the connections they killed.

    ``relay_slots``: this worker's relay slots (behind NAT; None for a public worker). ``in_flight()``:
    the runner of the attempt under way, if any. ``in_background(coro)``: runs a coroutine on the event
    loop (called there). ``on_round_thread(fn)``: runs ``fn`` on the round thread (``RuntimeError`` once
    it is shut down). ``snapshot``: the run's workers as last read."""

    def __init__(self, p2p: P2P, peer_id: str, records: RunRecords, presence: Presence,
                 relay_slots: RelaySlots | None, unreachable: UnreachablePeers, *, loop: asyncio.AbstractEventLoop,
                 in_flight: Callable[[], RoundRunner | None], in_background: Callable,
                 on_round_thread: Callable[[Callable[[], None]], concurrent.futures.Future],
                 snapshot: RunSnapshot):
        self.p2p, self.peer_id, self.records, self.presence = p2p, peer_id, records, presence
        self.relay_slots, self.unreachable, self.loop = relay_slots, unreachable, loop
        self.in_flight, self.in_background, self.on_round_thread = in_flight, in_background, on_round_thread
        self.snapshot = snapshot

    def start(self) -> None:
        """Listens to what tells of a move, and (behind NAT) starts keeping and watching the relay slots."""
        self.presence.on_new_address = self.on_new_address
        self.presence.on_rejoined = self.on_rejoined
        self.records.on_peers_moved = self.note_peers_moved
        if self.relay_slots is not None:  # behind NAT: a relay that restarted forgot its slot there
            self.relay_slots.on_moved = self.on_router_moved
            self.relay_slots.on_slot_back = self.on_slot_back
            self.loop.call_soon_threadsafe(self._keep_relay_slots)

    def _keep_relay_slots(self) -> None:
        self.in_background(self.relay_slots.keep())
        self.in_background(self.relay_slots.watch())
        self.in_background(self._widen_relays())

    async def _widen_relays(self) -> None:
        """Behind NAT: slots on the run's public workers too, named in this worker's record (``widen``)."""
        while True:
            await asyncio.sleep(WIDEN_EVERY_S)
            try:
                if await widen(self.relay_slots, self.peer_id, self.snapshot.workers):
                    self.presence.relays = self.relay_slots.named()
                    self.presence.publish_soon()
            except Exception as e:  # the next look tries again
                log.debug("holding slots on the run's workers: %s: %s", type(e).__name__, e)

    async def ping(self, peer: str) -> bool | None:
        """libp2p's ping, as ``swarm/connectivity/frozen.py`` reads it (this node's daemon is up once the loop runs)."""
        return await ping(self.p2p, peer, timeout=PING_TIMEOUT_S)

    def on_new_address(self, gone: list[str], now: list[str]) -> None:
        log.warning("this worker's address changed (%s gone; %s now): closing its connections so that streams "
                    "dial anew%s", " ".join(gone), " ".join(now),
                    ", and abandoning the attempt in flight" if self.in_flight() else "")
        self.in_background(self.readdressed())

    def on_router_moved(self, relay: str) -> None:
        self._router_moved(f"this worker's connection to its relay {relay[-8:]} broke, and a new one holds its "
                           "slot again", keep={relay})  # its new connection to the relay holds its slot

    def _router_moved(self, sign: str, keep: set[str]) -> None:
        log.warning("%s: its router's address changed. Closing its connections so that streams dial anew%s", sign,
                    ", and abandoning the attempt in flight" if self.in_flight() else "")
        self.in_background(self.readdressed(keep=keep))

    def on_slot_back(self, relay: str) -> None:
        """The members behind NAT this worker could not dial while the relay was down are tried again at
        once, not only after ``UNREACHABLE_ROUNDS`` outer steps (their slots come back with the relay:
        in the long scenario the two NAT'd workers stayed apart 35 s after the bootstrap's return)."""
        def forget() -> None:  # on the round thread, which alone reads and names them (between two rounds)
            natted = [p for p in self.unreachable.named() if self.records.relay_book.of(p)]
            if natted:
                log.info("relay %s is back: trying %s again (behind NAT, named unreachable while it was down)",
                         relay[-8:], ", ".join(p[-8:] for p in natted))
                self.unreachable.forget(natted)

        try:
            self.on_round_thread(forget)
        except RuntimeError:  # this worker is stopping
            pass

    def on_rejoined(self) -> None:
        """Behind NAT, the other sign of its router's move: its DHT node lost every peer at once and its
        redial found them at once (it may beat the relay watch to the relay's connection, and the
        watch then sees a live one). Not within ``OWN_CLOSE_GRACE_S`` of closing its connections itself."""
        if self.relay_slots is None or self.relay_slots.closed_recently():
            return
        self._router_moved("this worker's DHT node lost every peer at once and found them again at the redial",
                           keep=set(self.relay_slots.relays))

    async def readdressed(self, keep: set[str] | frozenset[str] = frozenset()) -> None:
        """Its connections through the old address are dead, and a stream on one hangs until a transport
        timeout (39-58 s in the world scenario), its own and the members' to it alike: they are closed,
        and an attempt in flight is abandoned, which its record says, so the members stop waiting on it
        at once rather than after ``cut_off_after``. Its record counts the move (``WorkerRecord.moves``):
        its peers' connections to it are as dead, and they close them when they read it. Connections to
        ``keep`` were dialled since the move, and stay."""
        runner = self.in_flight()
        self.presence.moves += 1
        try:
            peers = {info.peer_id.to_base58() for info in await asyncio.wait_for(self.p2p.list_peers(), DIAL_TIMEOUT)}
        except Exception as e:  # asyncio.TimeoutError included: the members' connections are closed still
            log.debug("listing this node's connections: %s: %s", type(e).__name__, e)
            peers = set()
        if runner is not None:
            peers |= set(runner.group.members)
        if self.relay_slots is not None:  # its relays forget its slots with its connections to them (and
            self.relay_slots.renew_soon()  # the closes below are its own: no new move)
        await self.disconnect(peers - {self.peer_id} - set(keep))
        if runner is not None:
            await runner.abandon("this worker's address changed")  # which publishes its record
        else:
            self.presence.publish_soon()

    def cut_off(self) -> None:
        """This worker takes itself for cut off from a round's members: behind NAT, its router's address
        may have changed, and its relays dropped its slots with its connections to them."""
        if self.relay_slots is not None:
            self.relay_slots.renew_soon()

    def note_peers_moved(self, peers: set[str]) -> None:
        """``RunRecords.on_peers_moved`` (any thread): ``peers_moved`` on the loop."""
        try:
            self.loop.call_soon_threadsafe(lambda: self.in_background(self.peers_moved(peers)))
        except RuntimeError:  # the loop is closed: this worker is stopping
            pass

    async def peers_moved(self, peers: set[str]) -> None:
        """``peers``' records say their address changed: this node's connections to them are dead (streams
        on them hang until a transport timeout), so they are closed and the next stream dials the new
        address. Behind NAT this worker dials them at once: they cannot dial it back."""
        peers = peers - {self.peer_id}
        if not peers:
            return
        log.info("the address of %s changed (their records say): closing the connections to them so that "
                 "streams dial them anew", ", ".join(sorted(p[-8:] for p in peers)))
        await self.disconnect(peers)
        if self.presence.publish_addrs:
            return
        book = self.records.address_book
        await asyncio.gather(*(dial_addrs(self.p2p, p, book.of(p)) for p in sorted(peers) if book.of(p)))

    async def disconnect(self, peers: set[str]) -> None:
        """Closes this node's connections to ``peers``: ones that hang are then dialled anew."""
        if self.relay_slots is not None:
            self.relay_slots.closing(peers)
        await asyncio.gather(*(close_connections(self.p2p, p) for p in sorted(peers)))
