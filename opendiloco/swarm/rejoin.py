"""Staying in the run's DHT: a node that has lost every peer dials its initial peers again.

hivemind drops a peer from a node's routing table when a request to it fails, and dials the initial
peers only once, at start. A node whose links all broke at once (its router got a new address, a
partition, a laptop that changed networks) therefore knows nobody afterwards: its reads find only its
own records, and its worker, seeing no other live worker, trained alone for the rest of the run with
``ok`` rounds, a split that never healed (measured in the emulated world, ``renat.toml``). Two parts:

- ``redial`` (run in the DHT process, each heartbeat): a node that knows no peer connects to its
  initial peers again and pings them, which puts them back in its routing table, then looks up its
  own neighbours to learn the rest of the run again. So does a node that knows fewer than half the
  peers it knew at most (``Presence``), dialling the initial peers its table lacks: the smaller
  side of a partition keeps its few peers on its side, so it never knew none, and learnt of the
  other side's records again only by chance, some 40 s after the partition healed, training on a
  fork all the while (the long scenario); now within a heartbeat or two of the heal.
  An initial peer that does not answer over the connection the daemon holds to it is dialled anew:
  after an address change that connection is gone, and the daemon, which dials nobody it holds a
  connection to, let every redial wait on it until its transport noticed (32 s in the world).
- ``cut_off`` (``Presence.cut_off``): whether a node with initial peers still knows none after that.
  Such a worker does not apply a round alone (matchmaking): it cannot tell an empty run from one it
  cannot see, and a round of one would fork θ_global from the run's.
"""

from __future__ import annotations

import asyncio
import logging
from typing import NamedTuple

from hivemind.p2p import PeerID
from hivemind.utils.multiaddr import Multiaddr

from .relays import close_connections

log = logging.getLogger(__name__)

REDIAL_TIMEOUT = 10.0
"""Seconds one initial peer gets to answer a redial (connect and ping; again on a new connection if the
first ping, of hivemind's 3 s, found none)."""


class Redial(NamedTuple):
    """What ``redial`` did: peers its node knew before and after, and whether its connections were found
    dead (an initial peer answered only on a new connection: its address changed) and renewed."""

    before: int
    after: int
    renewed: bool = False


def known_peers(node) -> int:
    """How many peers the DHT node's routing table holds."""
    return len(node.protocol.routing_table.uid_to_peer_id)


async def count_known_peers(_dht, node) -> int:
    """``known_peers`` as ``dht.run_coroutine`` runs it."""
    return known_peers(node)


async def redial(_dht, node, initial_peers: tuple[str, ...], timeout: float = REDIAL_TIMEOUT,
                 below: int = 1) -> Redial:
    """If the node knows fewer than ``below`` peers, it dials
    those of ``initial_peers`` (each a full multiaddr with ``/p2p/``) that its routing table lacks and,
    if one answers, finds its neighbours anew."""
    before = known_peers(node)
    table = node.protocol.routing_table
    initial_peers = tuple(m for m in initial_peers if PeerID.from_base58(Multiaddr(m)["p2p"]) not in table)
    if before >= below or not initial_peers:
        return Redial(before, before)

    answered = await _dial_all(node, initial_peers, timeout)
    renewed = {peer for peer, anew in answered.items() if anew}
    if before == 0 and renewed:
        # Knowing nobody, with a dead connection to an initial peer that answers on a new one: this
        # node's address changed, and every connection its daemon holds is as dead (streams of rounds,
        # records pushed, the DHT's requests to the rest of the run would all wait on them).
        await _reconnect_all_but(node.p2p, renewed)
    for _ in range(20):  # call_ping puts an answering peer in the table from a task of its own
        if known_peers(node):
            break
        await asyncio.sleep(0.05)
    if known_peers(node):
        try:
            await asyncio.wait_for(node.find_nearest_nodes([node.node_id]), timeout)
        except Exception as e:  # the table holds the initial peers already: the rest comes with use
            log.debug("redial: finding neighbours: %s", e)
    return Redial(before, known_peers(node), before == 0 and bool(renewed))


async def check_connections(_dht, node, initial_peers: tuple[str, ...], timeout: float = REDIAL_TIMEOUT) -> bool:
    """Whether this node's connections were dead, and are renewed: no initial peer answered over the
    connection the daemon holds to it, and one did on a new one (this node's address changed). Its
    other connections are then renewed too. Asked by a worker that heard nothing from its round's
    members (``SwarmCommunicator._cut_off``): a node behind NAT whose router got a new address may
    still know its peers, so ``redial`` never looks."""
    answered = await _dial_all(node, initial_peers, timeout)
    if not answered or not all(answered.values()):
        return False
    await _reconnect_all_but(node.p2p, set(answered))
    return True


async def _dial_all(node, initial_peers: tuple[str, ...], timeout: float) -> dict[str, bool]:
    """Connects to and pings each initial peer; of those that answered, whether only on a new connection."""
    async def dial(maddr: str) -> bool:
        addr = Multiaddr(maddr)
        peer = PeerID.from_base58(addr["p2p"])
        where = [addr.decapsulate(Multiaddr(f"/p2p/{addr['p2p']}"))]
        await node.p2p._client.connect(peer, where)
        if await node.protocol.call_ping(peer) is not None:
            return False
        # The daemon may still hold a connection that is gone (this node's address changed): it dials
        # nothing while it has one, and every request waits on it until the transport gives up on it
        # (30-40 s in the world scenario). Closed, the next connect dials anew.
        await close_connections(node.p2p, addr["p2p"])
        await node.p2p._client.connect(peer, where)
        if await node.protocol.call_ping(peer) is None:
            raise ConnectionError(f"{addr['p2p'][-8:]} does not answer")
        return True

    dials = [asyncio.ensure_future(asyncio.wait_for(dial(m), timeout)) for m in initial_peers]
    if dials:
        await asyncio.wait(dials)
    answered = {}
    for maddr, task in zip(initial_peers, dials):
        if task.cancelled() or task.exception() is not None:
            log.debug("redial: %s", "cancelled" if task.cancelled() else task.exception())
        else:
            answered[Multiaddr(maddr)["p2p"]] = task.result()
    return answered


async def _reconnect_all_but(p2p, keep: set[str]) -> None:
    """Closes every connection the daemon holds but to ``keep``, and dials each peer anew where it was:
    the new connections tell them this node's new address (libp2p's identify)."""
    try:
        held = await asyncio.wait_for(p2p.list_peers(), REDIAL_TIMEOUT)
    except Exception as e:  # its peers still learn of it from its record
        log.debug("redial: listing connections: %s", e)
        return
    held = [info for info in held if info.peer_id.to_base58() not in keep]
    log.info("redial: this node's connections were dead (its address changed): renewing the %d it holds", len(held))

    async def renew(info) -> None:
        await close_connections(p2p, info.peer_id.to_base58())
        try:
            await asyncio.wait_for(p2p._client.connect(info.peer_id, list(info.addrs)), REDIAL_TIMEOUT)
        except Exception as e:  # a peer behind NAT, or gone: dialled when a stream needs it
            log.debug("redial: reconnecting %s: %s", info.peer_id.to_base58()[-8:], e)

    await asyncio.gather(*(renew(info) for info in held))
