"""A DHT node that lost every peer dials its initial peers again (``swarm/connectivity/rejoin.py``), over real
DHT nodes on 127.0.0.1. hivemind drops a peer from the routing table when a request to it fails and
never dials its initial peers again: the test empties the table as a broken link would."""

from __future__ import annotations

import asyncio
import functools
import threading

import hivemind
import pytest
from hivemind.utils import get_dht_time

from opendiloco.swarm.connectivity.rejoin import count_known_peers, redial

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(120)]


async def forget_every_peer(_dht, node) -> int:
    """What failed requests to every peer leave behind (run in the DHT process)."""
    table = node.protocol.routing_table
    for uid in list(table.uid_to_peer_id):
        del table[uid]
    return len(table.uid_to_peer_id)


@pytest.fixture
def bootstrap():
    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        yield dht
    finally:
        dht.shutdown()


@pytest.fixture
def joined(bootstrap):
    """(a client-mode node that joined through ``bootstrap``, its initial peers)."""
    peers = tuple(str(m) for m in bootstrap.get_visible_maddrs())
    node = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=list(peers), client_mode=True)
    try:
        yield node, peers
    finally:
        node.shutdown()


def test_a_node_that_lost_every_peer_dials_its_initial_peers_again_and_reads_the_run(bootstrap, joined):
    node, peers = joined
    bootstrap.store("run.workers", "a record", get_dht_time() + 60)
    assert node.run_coroutine(forget_every_peer) == 0
    assert node.get("run.workers", latest=True) is None  # cut off: it reads nothing, for ever
    assert node.run_coroutine(functools.partial(redial, initial_peers=peers)) == (0, 1)
    assert node.get("run.workers", latest=True).value == "a record"
    assert node.run_coroutine(functools.partial(redial, initial_peers=peers)) == (1, 1)  # knows one: no dial


def test_a_node_whose_initial_peers_are_gone_stays_cut_off(bootstrap, joined):
    node, peers = joined
    bootstrap.shutdown()
    node.run_coroutine(forget_every_peer)
    assert node.run_coroutine(functools.partial(redial, initial_peers=peers, timeout=2.0)) == (0, 0)
    assert node.run_coroutine(count_known_peers) == 0


async def forget_peers(_dht, node, peer_ids: tuple[str, ...]) -> int:
    """What failed requests to these peers leave behind (run in the DHT process)."""
    from hivemind.p2p import PeerID

    table = node.protocol.routing_table
    for peer in peer_ids:
        uid = table.get(peer_id=PeerID.from_base58(peer))
        if uid is not None:
            del table[uid]
    return len(table.uid_to_peer_id)


def test_a_node_that_lost_most_of_its_peers_dials_the_initial_peers_it_lacks(bootstrap, joined):
    """The smaller side of a partition keeps its peers on its side: it never knows none. A node that knows
    fewer than ``below`` peers dials the initial peers its table lacks (and only those)."""
    node, peers = joined
    others = [hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=list(peers))
              for _ in range(2)]
    try:
        for other in others:  # it learns the other nodes of the run
            node.store(f"from-{other.peer_id}", 1, get_dht_time() + 60)
            other.get(f"from-{other.peer_id}")
        node.run_coroutine(functools.partial(redial, initial_peers=peers))  # knows some: a no-op
        assert node.run_coroutine(count_known_peers) == 3
        boot = str(bootstrap.peer_id)
        assert node.run_coroutine(functools.partial(forget_peers, peer_ids=(boot, str(others[0].peer_id)))) == 1
        assert node.run_coroutine(functools.partial(redial, initial_peers=peers, below=1)) == (1, 1)  # not below
        before, after = node.run_coroutine(functools.partial(redial, initial_peers=peers, below=2))
        assert before == 1 and after >= 2
        # Its initial peer known, it dials nobody, however few it knows (without a dial the count is read once;
        # the table may meanwhile learn a peer that sends it a request).
        node.run_coroutine(functools.partial(forget_peers, peer_ids=tuple(str(o.peer_id) for o in others)))
        before, after = node.run_coroutine(functools.partial(redial, initial_peers=peers, below=100))
        assert before == after
    finally:
        for other in others:
            other.shutdown()



class FreezingProxy:
    """A TCP proxy on 127.0.0.1 whose connections can be made to go silent, while new ones still pass:
    what a host whose address changed sees (its old connections dead without a word, a dial from the
    new address working)."""

    def __init__(self, target_port: int):
        self.target_port = target_port
        self.frozen = False
        self._old: list = []
        self._loop = asyncio.new_event_loop()
        self._server = None
        started = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(started,), daemon=True)
        self._thread.start()
        assert started.wait(10), "the proxy did not start"

    def _run(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)

        async def start():
            self._server = await asyncio.start_server(self._pass, "127.0.0.1", 0)
            self.port = self._server.sockets[0].getsockname()[1]
            started.set()

        self._loop.run_until_complete(start())
        self._loop.run_forever()

    async def _pass(self, reader, writer) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        conn = {"frozen": False}
        self._old.append(conn)

        async def pump(src, dst):
            try:
                while data := await src.read(65536):
                    while conn["frozen"]:  # silent: nothing passes, nothing closes
                        await asyncio.sleep(0.1)
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, OSError):
                pass

        await asyncio.gather(pump(reader, up_writer), pump(up_reader, writer))

    def freeze_existing(self) -> int:
        """Silences every connection made so far; returns how many."""
        for conn in self._old:
            conn["frozen"] = True
        return len(self._old)

    def close(self) -> None:
        async def stop():
            self._server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()


def test_a_node_whose_connection_died_silently_dials_its_initial_peer_anew(bootstrap):
    """A node whose address changed keeps, in its p2p daemon, a connection to its initial peer that is
    gone without a word. The daemon dials nobody it holds a connection to, so the redial pinged over the
    dead one and failed, heartbeat after heartbeat, until the transport gave up on it (32 s in the world
    scenario ``midround.toml``). Now a peer that does not answer there is dialled on a new connection."""
    boot_port = int(next(str(m) for m in bootstrap.get_visible_maddrs()).split("/tcp/")[1].split("/")[0])
    proxy = FreezingProxy(boot_port)
    peers = (f"/ip4/127.0.0.1/tcp/{proxy.port}/p2p/{bootstrap.peer_id}",)
    # Listening nowhere: the bootstrap cannot dial it back, so the proxied connection is its only one.
    node = hivemind.DHT(start=True, host_maddrs=[], initial_peers=list(peers), client_mode=True)
    try:
        assert node.run_coroutine(count_known_peers) == 1
        assert proxy.freeze_existing() >= 1
        assert node.run_coroutine(forget_every_peer) == 0
        assert node.run_coroutine(functools.partial(redial, initial_peers=peers)) == (0, 1)
        bootstrap.store("run.workers", "a record", get_dht_time() + 60)
        assert node.get("run.workers", latest=True).value == "a record"  # over the new connection
    finally:
        node.shutdown()
        proxy.close()
