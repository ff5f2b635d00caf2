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

from hivemind.p2p import PeerID
from hivemind.utils.multiaddr import Multiaddr

from ...timeouts import REDIAL_TIMEOUT
from ..daemon import hivemind_privates
from .relays import close_connections

log = logging.getLogger(__name__)


def known_peers(node) -> int:
    """How many peers the DHT node's routing table holds."""
    return len(node.protocol.routing_table.uid_to_peer_id)


async def count_known_peers(_dht, node) -> int:
    """``known_peers`` as ``dht.run_coroutine`` runs it."""
    return known_peers(node)


async def redial(_dht, node, initial_peers: tuple[str, ...], timeout: float = REDIAL_TIMEOUT,
                 below: int = 1) -> tuple[int, int]:
    """(peers known before, peers known after): if the node knows fewer than ``below`` peers, it dials
    those of ``initial_peers`` (each a full multiaddr with ``/p2p/``) that its routing table lacks and,
    if one answers, finds its neighbours anew."""
    before = known_peers(node)
    table = node.protocol.routing_table
    initial_peers = tuple(m for m in initial_peers if PeerID.from_base58(Multiaddr(m)["p2p"]) not in table)
    if before >= below or not initial_peers:
        return before, before

    async def dial(maddr: str) -> None:
        addr = Multiaddr(maddr)
        peer = PeerID.from_base58(addr["p2p"])
        where = [addr.decapsulate(Multiaddr(f"/p2p/{addr['p2p']}"))]
        await hivemind_privates.connect(node.p2p, peer, where)
        if await node.protocol.call_ping(peer) is None:
            # The daemon may still hold a connection that is gone (this node's address changed): it dials
            # nothing while it has one, and every request waits on it until the transport gives up on it
            # (30-40 s in the world scenario). Closed, the next connect dials anew.
            await close_connections(node.p2p, addr["p2p"])
            await hivemind_privates.connect(node.p2p, peer, where)
            await node.protocol.call_ping(peer)

    dials = [asyncio.ensure_future(asyncio.wait_for(dial(m), timeout)) for m in initial_peers]
    await asyncio.wait(dials)
    for task in dials:
        if not task.cancelled() and task.exception() is not None:
            log.debug("redial: %s", task.exception())
    for _ in range(20):  # call_ping puts an answering peer in the table from a task of its own
        if known_peers(node):
            break
        await asyncio.sleep(0.05)
    if known_peers(node):
        try:
            await asyncio.wait_for(node.find_nearest_nodes([node.node_id]), timeout)
        except Exception as e:  # the table holds the initial peers already: the rest comes with use
            log.debug("redial: finding neighbours: %s", e)
    return before, known_peers(node)
