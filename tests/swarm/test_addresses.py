"""A public worker's record names where it listens, and a stream whose dial failed tries there
(``swarm/connectivity/addresses.py``): a worker re-addressed mid-run is reached again at once, also by a worker
behind NAT, which learns the new address from nothing else."""

from __future__ import annotations

import asyncio
import time

import pytest

from opendiloco.errors import Unreachable
from opendiloco.swarm import presence
from opendiloco.swarm.communicator import SwarmCommunicator
from opendiloco.swarm.connectivity.addresses import (
    MAX_ADDRS,
    AddressBook,
    checked_addrs,
    is_local,
    own_addrs,
    plain_address,
)
from opendiloco.swarm.daemon.node import start_dht
from opendiloco.swarm.presence import ADDRS_EVERY_S
from opendiloco.swarm.records import WorkerRecord
from opendiloco.swarm.settings import SwarmSettings
from opendiloco.swarm.streams import P2PStreams

pytestmark = pytest.mark.timeout(120)

PEER = "12D3KooWJbER3pdJS7sBKAQtLHiLbkUSp4a6E6wobNQYbdv5jWxy"


@pytest.mark.parametrize("addr", ["/ip4/10.0.0.2/tcp/4001", "/ip6/::1/tcp/1", "/dns4/eu-1.example/tcp/31337",
                                  "/ip4/10.0.0.2/udp/4001/quic"])
def test_a_plain_address_is_named(addr):
    assert plain_address(addr) and checked_addrs([addr]) == (addr,)


@pytest.mark.parametrize("value", [
    "/ip4/10.0.0.2/tcp/4001",  # not a list
    ["/ip4/10.0.0.2/tcp/1"] * (MAX_ADDRS + 1),  # too many
    ["/ip4/10.0.0.2/tcp/1", 7],  # not text
    ["/dns4/" + "a" * 200 + "/tcp/1"],  # too long
    ["/p2p-circuit"], ["/ip4/10.0.0.2/tcp/1/p2p-circuit"],  # relays are another field
    [f"/ip4/10.0.0.2/tcp/1/p2p/{PEER}"],  # a peer id: another peer's, maybe
    ["/ip4/10.0.0.2"], ["/tcp/1"], ["not an address"], [""],
])
def test_a_record_with_malformed_addresses_is_dropped(value):
    assert checked_addrs(value) is None
    assert WorkerRecord.from_value(PEER, {"addrs": value}) is None
    assert WorkerRecord.from_value(PEER, {"addrs": ["/ip4/10.0.0.2/tcp/1"]}).addrs == ("/ip4/10.0.0.2/tcp/1",)


def test_a_record_names_its_daemons_plain_addresses_other_than_loopback_first():
    visible = [f"/ip4/127.0.0.1/tcp/5/p2p/{PEER}", f"/ip4/10.1.0.2/tcp/5/p2p/{PEER}", "/ip4/10.1.0.2/tcp/5",
               f"/ip4/10.9.0.1/tcp/7/p2p/{PEER}/p2p-circuit", "/ip4/10.2.0.2/tcp/5", "/ip4/10.3.0.2/tcp/5",
               "/ip4/10.4.0.2/tcp/5"]
    assert own_addrs(visible) == ("/ip4/10.1.0.2/tcp/5", "/ip4/10.2.0.2/tcp/5", "/ip4/10.3.0.2/tcp/5",
                                  "/ip4/10.4.0.2/tcp/5")
    assert checked_addrs(own_addrs(visible)) is not None
    assert own_addrs(reversed(visible)) == own_addrs(visible)  # whatever order the daemon lists them in


def test_an_address_is_this_workers_own_only_while_it_is_on_an_interface():
    """A daemon also lists where its peers saw it (observed addresses), for a while after the address is
    gone: only an address this machine can bind counts as where it listens."""
    assert is_local("/ip4/127.0.0.1/tcp/31337") and is_local("/ip4/127.0.0.9/tcp/1")
    assert not is_local("/ip4/192.0.2.7/tcp/31337")  # TEST-NET-1: on no interface here
    assert not is_local("/dns4/localhost/tcp/1") and not is_local("not an address")


@pytest.fixture
def islands():
    """``a`` in one DHT with ``d``; ``b`` and ``c`` each alone: ``a``'s daemon can find neither."""
    nodes = []

    def start(initial_peers=()):
        node = start_dht(initial_peers=list(initial_peers), host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        nodes.append(node)
        return node

    d = start()
    a = start([str(m) for m in d.get_visible_maddrs()])
    yield a, start(), start()
    for node in nodes:
        node.shutdown()


@pytest.mark.swarm
def test_a_stream_whose_dial_failed_goes_to_the_addresses_the_peers_record_names(islands):
    a, b, c = islands

    async def play():
        pa, pb, pc = await a.replicate_p2p(), await b.replicate_p2p(), await c.replicate_p2p()
        book = AddressBook()
        mine = P2PStreams(pa, "opendiloco.addresses.reduce", address_book=book)
        heard = {"b": [], "c": []}
        for name, p2p in (("b", pb), ("c", pc)):
            await P2PStreams(p2p, "opendiloco.addresses.reduce").listen(
                lambda stream, name=name: asyncio.sleep(0, heard[name].append(stream.remote)))
        peer_b = pb.peer_id.to_base58()
        with pytest.raises(Unreachable):  # nothing tells a's daemon where b is (on the code before: the end)
            await mine.connect(peer_b)

        # An insider whose record names another peer's address (c's) as its own: the dial reaches c's
        # daemon, which is not b, so it fails authenticated, and c's handler never sees a stream.
        book.note({peer_b: (1.0, own_addrs(await pc.get_visible_maddrs(latest=True)), 0)})
        began = time.monotonic()
        with pytest.raises(Unreachable):
            await mine.connect(peer_b)
        assert time.monotonic() - began < 30  # bounded by the dials' timeouts

        # Its true addresses, as its record names them: reached.
        book.note({peer_b: (2.0, own_addrs(await pb.get_visible_maddrs(latest=True)), 0)})
        stream = await mine.connect(peer_b)
        assert stream.remote == peer_b
        deadline = time.monotonic() + 30
        while not heard["b"]:
            assert time.monotonic() < deadline, heard
            await asyncio.sleep(0.05)
        stream.close()
        assert heard == {"b": [pa.peer_id.to_base58()], "c": []}

    asyncio.run(play())


@pytest.mark.swarm
def test_a_public_workers_record_names_where_it_listens():
    first = start_dht(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    comm = SwarmCommunicator(first, SwarmSettings(run_id="addresses"), own_dht=False)
    try:
        deadline = time.monotonic() + 60
        while not (rec := comm.live_workers().get(comm.peer_id)) or not rec.addrs:
            assert time.monotonic() < deadline, rec
            time.sleep(0.2)
        listening = {str(m).split("/p2p/")[0] for m in first.get_visible_maddrs()}
        assert set(rec.addrs) <= listening and rec.addrs, (rec.addrs, listening)
        assert comm.records.address_book.of(comm.peer_id) == rec.addrs
    finally:
        comm.close()
        first.shutdown()


def test_the_address_book_says_who_moved():
    book = AddressBook()
    assert book.note({"a": (1.0, ("/ip4/10.0.0.1/tcp/1",), 0), "b": (1.0, ("/ip4/10.0.0.2/tcp/1",), 0)}) == set()
    # a added an address (no move), b's is gone (moved), c is new.
    moved = book.note({"a": (2.0, ("/ip4/10.0.0.1/tcp/1", "/ip4/10.9.0.1/tcp/1"), 0),
                       "b": (2.0, ("/ip4/10.0.0.7/tcp/1",), 0), "c": (2.0, ("/ip4/10.0.0.3/tcp/1",), 0)})
    assert moved == {"b"}
    # A stale copy of b's old record (a DHT node that missed the new one) is no move back, nor is the
    # newer one after it a move again.
    assert book.note({"b": (1.5, ("/ip4/10.0.0.2/tcp/1",), 0)}) == set()
    assert book.note({"b": (2.5, ("/ip4/10.0.0.7/tcp/1",), 0)}) == set() and book.of("b") == ("/ip4/10.0.0.7/tcp/1",)
    # A worker missing from reads (its old record expired before it published from its new address) is
    # remembered: back with another address, it moved.
    assert book.note({"a": (3.0, ("/ip4/10.0.0.1/tcp/1", "/ip4/10.9.0.1/tcp/1"), 0)}) == set()
    assert book.note({"b": (9.0, ("/ip4/10.0.0.8/tcp/1",), 0), "c": (9.0, (), 0)}) == {"b"}
    assert book.of("b") == ("/ip4/10.0.0.8/tcp/1",)
    assert book.of("c") == ("/ip4/10.0.0.3/tcp/1",)  # a record that names none says nothing
    # A worker behind NAT names no address: it moved when its count of moves grew, not before, and a
    # stale copy of an older count is no move.
    assert book.note({"n": (1.0, (), 0)}) == set() and book.note({"n": (2.0, (), 0)}) == set()
    assert book.note({"n": (3.0, (), 1)}) == {"n"}
    assert book.note({"n": (2.5, (), 0)}) == set() and book.note({"n": (4.0, (), 1)}) == set()
    assert book.of("n") == ()
    small = AddressBook(capacity=2)
    small.note({p: (1.0, (f"/ip4/10.0.0.{i}/tcp/1",), 0) for i, p in enumerate("abc")})
    assert small.of("a") == () and small.of("c")  # bounded: the least recently read go first


@pytest.mark.swarm
def test_the_others_drop_their_connections_to_a_worker_whose_record_says_it_moved():
    """A worker's address changed: its peers' connections to its old address are dead, and their streams
    to it (a round's parts, a settle's question) hung on them until a transport timeout (14 s of one
    settle in ``natpeer.toml``). Its next record names other addresses; the peers close their
    connections to it then, so the next stream dials the new address."""
    first = start_dht(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    peers = [str(m) for m in first.get_visible_maddrs()]
    second = start_dht(initial_peers=peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    settings = SwarmSettings(run_id="moved")
    watcher, mover = SwarmCommunicator(first, settings, own_dht=False), SwarmCommunicator(second, settings)
    closed: list[set[str]] = []

    async def record_closing(peers):
        closed.append(set(peers))

    watcher.connectivity.disconnect = record_closing
    try:
        deadline = time.monotonic() + 60
        while not watcher.records.address_book.of(mover.peer_id):
            assert time.monotonic() < deadline, "the mover's record never named its addresses"
            watcher.live_workers()
            time.sleep(0.2)
        assert closed == []  # nobody moved yet

        async def elsewhere():
            return ["/ip4/127.0.0.9/tcp/4321"]

        mover.presence.find_addrs = elsewhere
        while mover.peer_id not in set().union(*closed):
            assert time.monotonic() < deadline, closed
            watcher.live_workers()
            time.sleep(0.2)
        assert watcher.records.address_book.of(mover.peer_id) == ("/ip4/127.0.0.9/tcp/4321",)
    finally:
        mover.close()
        watcher.close()
        first.shutdown()


@pytest.mark.swarm
def test_a_worker_sees_its_own_move_while_its_heartbeat_hangs():
    """Just after a worker's address changes, its heartbeat's DHT store hangs on its dead connections (20 s
    in the long scenario): a move looked for only before each heartbeat was seen that late, and the
    worker went on sending into dead connections meanwhile. Its addresses are looked at beside the
    heartbeat too."""
    first = start_dht(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    second = start_dht(initial_peers=[str(m) for m in first.get_visible_maddrs()], host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    mover = SwarmCommunicator(second, SwarmSettings(run_id="moved"))
    released, hanging, moves = asyncio.Event(), [], []

    async def store_hangs(*args, **kwargs):
        hanging.append(True)
        await released.wait()

    async def elsewhere():
        return ["/ip4/127.0.0.9/tcp/4321"]

    try:
        deadline = time.monotonic() + 60
        while not mover.presence.addrs:
            assert time.monotonic() < deadline, "the worker never looked where it listens"
            time.sleep(0.1)
        mover.presence.records.store_async = store_hangs
        while not hanging:  # the heartbeat is stuck in its store now
            assert time.monotonic() < deadline, "no heartbeat stored anything"
            time.sleep(0.1)
        mover.presence.on_new_address = lambda gone, now: moves.append((gone, now))
        mover.presence.find_addrs = elsewhere
        while not moves:
            assert time.monotonic() < deadline, "the move was not seen while the heartbeat hung"
            time.sleep(0.1)
        assert moves[0][0] and moves[0][1] == ["/ip4/127.0.0.9/tcp/4321"]  # its old addresses gone
        assert len(hanging) <= 2  # seen while the heartbeat's store still hung (the other: the new address's)
    finally:
        mover._loop.call_soon_threadsafe(released.set)
        mover.close()
        first.shutdown()


@pytest.mark.swarm
def test_a_moved_worker_publishes_its_new_address_at_once_and_never_loopback_alone(monkeypatch):
    """Mid-move the daemon listed loopback alone for a moment; the record then named only that, and its
    peers behind NAT dialled themselves until the next record (17 s in the long scenario). The old
    address now stands until the new one is listed, and a new address is published at once, not at the
    next heartbeat (an hour away here)."""
    dht = start_dht(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    mover = SwarmCommunicator(dht, SwarmSettings(run_id="moved", heartbeat_interval=3600.0, record_ttl=7200.0),
                              own_dht=False)
    stored, listed = [], ["/ip4/10.250.0.1/tcp/4321"]
    monkeypatch.setattr(presence, "is_local", lambda addr: addr in listed)  # the interfaces, as a move leaves them

    async def store(key, value, expiration):
        stored.append(tuple(value["addrs"]))

    async def daemon_lists():
        return list(listed)

    def wait_for(what, why):
        deadline = time.monotonic() + 60
        while not what():
            assert time.monotonic() < deadline, why
            time.sleep(0.05)

    try:
        wait_for(lambda: mover.presence.addrs, "the worker never looked where it listens")
        mover.presence.records.store_async = store
        mover.presence.find_addrs = daemon_lists
        wait_for(lambda: ("/ip4/10.250.0.1/tcp/4321",) in stored, "the first routable address was not published")
        listed[:] = ["/ip4/127.0.0.1/tcp/4321"]  # mid-move: loopback alone
        time.sleep(3 * ADDRS_EVERY_S)
        assert mover.presence.addrs == ("/ip4/10.250.0.1/tcp/4321",)
        listed[:] = ["/ip4/10.250.0.2/tcp/4321", "/ip4/127.0.0.1/tcp/4321"]
        wait_for(lambda: stored[-1] == ("/ip4/10.250.0.2/tcp/4321", "/ip4/127.0.0.1/tcp/4321"),
                 f"the new address was not published: {stored}")
        assert all(any(not a.startswith("/ip4/127.") for a in addrs) for addrs in stored), stored
    finally:
        mover.close()
        dht.shutdown()
