"""Where a public worker listens now, as its record says: dialled when the p2p daemon's own dial fails.

A worker whose address changes mid-run (a cloud VM re-addressed, a laptop on another network) keeps
its peer id, and its daemon announces the new address; but a peer's daemon dials the addresses it
learnt before, and a worker behind NAT, which public workers reach only on connections it dials
itself, learnt of the new one from nothing: it stayed out of that worker's groups until its DHT node
happened on the address (80 s in a scenario). So a public worker names the addresses its daemon
listens on in its record (``WorkerRecord.addrs``, at most ``MAX_ADDRS``), and a stream whose dial
failed is tried once more after a dial to those (``P2PStreams.connect``).

The same lookup is this worker's surest sign that its own address changed: an address its daemon
listened on is gone (``Presence.on_new_address``). Its connections through it are dead, and every
stream on them would hang until a transport timeout: it closes them at once, and abandons an attempt
in flight, which its record then says, so that the members stop waiting on it
(``watch.ConnectivityWatch.readdressed``). Its peers see it in its next record: an address it named is
gone. Their connections to it are as dead, and their streams to it (the round's parts, the settle's
question) hung there: they close them, so the next stream dials its new address; a worker behind NAT
dials it at once, as the moved worker cannot dial it back (``ConnectivityWatch.peers_moved``).

A record's addresses are its writer's word: a dial to them reaches the peer of that id or nobody
(libp2p authenticates the remote end), so a false one costs one failed dial of at most
``DIAL_TIMEOUT``, and only to a member this worker was about to dial anyway.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import socket
import threading
from collections.abc import Callable, Iterable, Sequence

from hivemind.p2p import P2P, PeerID
from hivemind.utils.multiaddr import Multiaddr

from ...timeouts import ADDRESS_DIAL_TIMEOUT as DIAL_TIMEOUT
from ..daemon import hivemind_privates

log = logging.getLogger(__name__)

MAX_ADDRS = 4
"""The most addresses a record may name (a reader drops a record with more)."""
MAX_ADDR_CHARS = 128
MAX_REMEMBERED = 4096
"""Workers whose addresses a worker remembers (the least recently read are forgotten first)."""
_HOSTS = {"ip4", "ip6", "dns", "dns4", "dns6"}
_TRANSPORTS = {"tcp", "udp"}


def plain_address(addr: str) -> bool:
    """Whether ``addr`` is a host and a port (``/ip4/A/tcp/P``, ...): no relay, no peer id."""
    try:
        names = [p.name for p in Multiaddr(addr).protocols()]
    except Exception:  # the library raises several types for text that is no multiaddr
        return False
    return len(names) >= 2 and names[0] in _HOSTS and names[1] in _TRANSPORTS and not (
        {"p2p", "ipfs", "p2p-circuit"} & set(names))


def checked_addrs(value) -> tuple[str, ...] | None:
    """The addresses a record names, or None if the field is malformed (input from the network)."""
    if not isinstance(value, (list, tuple)) or len(value) > MAX_ADDRS:
        return None
    if not all(isinstance(a, str) and len(a) <= MAX_ADDR_CHARS and plain_address(a) for a in value):
        return None
    return tuple(value)


def plain_addrs(visible: Iterable) -> list[str]:
    """The plain addresses among a daemon's visible ones, without their ``/p2p/ID`` (relayed ones left
    out: a relay's address is not this worker's)."""
    out: list[str] = []
    for maddr in visible:
        addr = str(maddr)
        if "/p2p-circuit" in addr:
            continue
        addr = addr.split("/p2p/", 1)[0]
        if addr not in out and len(addr) <= MAX_ADDR_CHARS and plain_address(addr):
            out.append(addr)
    return out


def is_local(addr: str) -> bool:
    """Whether ``addr``'s IP address is on one of this machine's interfaces now (it can be bound). A
    daemon also lists the addresses its peers saw it at (libp2p's observed addresses, once four peers
    agree), for a while after they are gone: after a move, the old address stayed listed beside the new
    one in a run of twelve, and neither this worker nor its peers saw it go."""
    parts = addr.split("/")
    if len(parts) < 3 or parts[1] not in ("ip4", "ip6"):
        return False
    family = socket.AF_INET if parts[1] == "ip4" else socket.AF_INET6
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.bind((parts[2], 0))
        return True
    except OSError:
        return False


def is_loopback(addr: str) -> bool:
    """Whether ``addr`` is a loopback address (no peer elsewhere can dial it)."""
    return addr.startswith(("/ip4/127.", "/ip6/::1/"))


def own_addrs(visible: Iterable) -> tuple[str, ...]:
    """What this worker's record names, from its daemon's visible addresses: the plain ones, other than
    loopback first, at most ``MAX_ADDRS``. Sorted, so that a daemon that lists more in another order
    names the same ones (its peers would take a new set for a move)."""
    out = sorted(plain_addrs(visible), key=lambda a: (is_loopback(a), a))
    return tuple(out[:MAX_ADDRS])


class AddressBook:
    """Each worker's addresses, from its last record read that named any (thread-safe; the
    ``capacity`` latest workers). A worker missing from a read is kept: a worker whose address changed
    may be missing from the reads for a while (its old record expired before its node published
    again from the new address), and must still be seen to have moved when it is back."""

    def __init__(self, capacity: int = MAX_REMEMBERED):
        self.capacity = capacity
        self._addrs: collections.OrderedDict[str, tuple[float, tuple[str, ...], int]] = collections.OrderedDict()
        self._lock = threading.Lock()

    def note(self, peers: dict[str, tuple[float, Sequence[str], int]]) -> set[str]:
        """The addresses of the workers just read, each with its record's time (its writer's clock) and
        its count of moves (``WorkerRecord.moves``); returns those that moved: an address their last
        record named is gone from a newer one, or their count grew (a worker behind NAT names no
        address, and says so when its router's changed). A record no newer than the last one noted is
        a stale copy: ignored. One that names no address keeps those noted before."""
        moved = set()
        with self._lock:
            for peer, (written, addrs, moves) in peers.items():
                before_time, before, before_moves = self._addrs.get(peer, (-math.inf, (), moves))
                if written <= before_time:
                    continue
                if (addrs and set(before) - set(addrs)) or moves > before_moves:
                    moved.add(peer)
                self._addrs.pop(peer, None)
                self._addrs[peer] = (written, tuple(addrs) or before, moves)
            while len(self._addrs) > self.capacity:
                self._addrs.popitem(last=False)
        return moved

    def of(self, peer: str) -> tuple[str, ...]:
        with self._lock:
            return self._addrs.get(peer, (0.0, (), 0))[1]


async def connect_within(p2p: P2P, peer: str, where: Callable[[], list[Multiaddr]], timeout: float
                         ) -> Exception | None:
    """Connects to ``peer`` at the addresses ``where`` makes (its daemon learns them) within ``timeout``;
    what went wrong, or None once connected (an address that does not parse is what went wrong too)."""
    try:
        await asyncio.wait_for(hivemind_privates.connect(p2p, PeerID.from_base58(peer), where()), timeout)
        return None
    except asyncio.CancelledError:
        raise
    except Exception as e:
        return e


async def dial_addrs(p2p: P2P, peer: str, addrs: Sequence[str], timeout: float = DIAL_TIMEOUT) -> bool:
    """Connects to ``peer`` at ``addrs``; False if that failed."""
    failed = await connect_within(p2p, peer, lambda: [Multiaddr(a) for a in addrs], timeout)
    if failed is not None:
        log.debug("could not reach %s at its record's addresses %s: %s: %s", peer[-8:], addrs,
                  type(failed).__name__, failed)
    return failed is None
