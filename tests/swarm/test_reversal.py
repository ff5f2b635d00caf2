"""Connection reversal over real p2p daemons on 127.0.0.1: a public relay, a public worker and a worker
behind NAT (listening nowhere) that has no way of its own to dial the public one.

In the long world scenario a worker behind NAT could not dial a public peer for 30 s to 2 minutes
after that peer came back from a freeze, a partition or a restart (libp2p's dial backoff), and the
public peer could not dial it either: every round that held both failed. The public worker now asks
it through its relay to dial back (``swarm/connectivity/reversal.py``).
"""

from __future__ import annotations

import asyncio
import time

import pytest
from hivemind.p2p import P2P, P2PDaemonError, PeerID
from hivemind.p2p.p2p_daemon_bindings.utils import ControlFailure
from hivemind.utils.multiaddr import Multiaddr

from opendiloco.comm.wire import Code, Refused, StreamClosed
from opendiloco.errors import Unreachable
from opendiloco.swarm.connectivity.addresses import AddressBook
from opendiloco.swarm.connectivity.relays import RelayBook, close_connections, daemon_options, dial_via
from opendiloco.swarm.connectivity.reversal import MIN_INTERVAL_S, ConnectionReversal, direct_connection
from opendiloco.swarm.daemon import hivemind_privates
from opendiloco.swarm.streams import P2PStreams
from opendiloco.testing.ports import free_port

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(120)]

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]


async def _joined(first: list[str], **kwargs) -> P2P:
    """A daemon that joins through ``first``; started again if its first dial there failed (a loaded
    machine: "failed to connect to bootstrap peers" came once beside the world scenario)."""
    for tries_left in (2, 1, 0):
        try:
            return await P2P.create(initial_peers=first, **kwargs)
        except P2PDaemonError:
            if not tries_left:
                raise


async def _relay_and_natted():
    """A relay, and a node behind NAT: a slot on the relay, no listening address."""
    relay = await P2P.create(host_maddrs=LOOPBACK, **daemon_options(False, []))
    try:
        first = [str(a) for a in await relay.get_visible_maddrs()]
        natted = await _joined(first, host_maddrs=[], **daemon_options(True, first))
        return relay, natted, first
    except BaseException:
        await relay.shutdown()
        raise


async def _public_after_backoff(natted: P2P, first: list[str], tmp_path) -> P2P:
    """A public node that the NAT'd one cannot dial: the NAT'd node dials its address until nothing
    listens there four times (libp2p then backs the address off for 14 s), and the node starts there."""
    identity = str(tmp_path / "public.key")
    P2P.generate_identity(identity)
    with open(identity, "rb") as f:
        peer = PeerID.from_identity(f.read())
    addr = f"/ip4/127.0.0.1/tcp/{free_port()}"
    failed = 0
    while failed < 4:  # a dial in backoff fails at once, without counting
        try:
            await hivemind_privates.connect(natted, peer, [Multiaddr(addr)])
        except ControlFailure as e:
            failed += "backoff" not in str(e)
        await asyncio.sleep(0.3)
    return await _joined(first, host_maddrs=[addr], identity_path=identity,
                            **daemon_options(False, []))


def _reversal(p2p: P2P, relays: dict) -> ConnectionReversal:
    book = RelayBook()
    for peer, names in relays.items():
        book.note(peer, names)
    return ConnectionReversal(p2p, P2PStreams(p2p, "opendiloco.test.reverse"), book, AddressBook())


async def _echo(stream) -> None:
    try:
        frame = await stream.recv(max_payload=16, expect=Code.PART)
        await stream.send(Code.CONFIRM, {"echo": frame.meta["i"]})
    finally:
        stream.close()


async def _reserved(public: P2P, natted_id: str, relays) -> None:
    """Waits until the NAT'd node holds its slot on the relay (a relayed dial to it succeeds), then closes
    that connection: nobody is connected to the NAT'd node but the relay."""
    for _ in range(100):
        if await dial_via(public, natted_id, relays, timeout=2.0):
            break
        await asyncio.sleep(0.2)
    else:
        raise AssertionError("the NAT'd node never held a slot on the relay")
    await close_connections(public, natted_id)


@pytest.mark.parametrize("reverse", [False, True], ids=["no-reversal", "reversal"])
def test_a_worker_behind_nat_whose_daemon_backed_off_a_public_one_is_reached_by_it(reverse, tmp_path):
    async def run():
        relay, natted, relays = await _relay_and_natted()
        public = None
        try:
            # Its slot on the relay, seen by another node: a relayed connection from the public one would lift
            # the very backoff the test builds (libp2p clears it on any connection, relayed ones included).
            prober = await _joined(relays, host_maddrs=LOOPBACK, **daemon_options(False, []))
            try:
                await _reserved(prober, natted.peer_id.to_base58(), relays)
            finally:
                await prober.shutdown()
            public = await _public_after_backoff(natted, relays, tmp_path)
            public_id, natted_id = public.peer_id.to_base58(), natted.peer_id.to_base58()
            with pytest.raises(ControlFailure, match="backoff"):  # it is up, and the NAT'd node will not dial it
                await hivemind_privates.connect(natted, public.peer_id, [])
            serving = _reversal(natted, {})
            await serving.streams.listen(serving.serve)
            await P2PStreams(natted, "opendiloco.test.data").listen(_echo)
            asking = _reversal(public, {natted_id: relays})
            data = P2PStreams(public, "opendiloco.test.data", reversal=asking if reverse else None)
            assert not await direct_connection(public, natted_id)
            if not reverse:
                with pytest.raises(Unreachable):
                    await data.connect(natted_id)
                return
            stream = await asyncio.wait_for(data.connect(natted_id), 60)
            await stream.send(Code.PART, {"i": 7})
            answer = await asyncio.wait_for(stream.recv(max_payload=0, expect=Code.CONFIRM), 20)
            stream.close()
            assert answer.meta["echo"] == 7
            assert asking.reversed == 1 and serving.dialled == 1
            assert await direct_connection(public, natted_id)  # the round's streams do not go through the relay
            assert await direct_connection(natted, public_id)
            await hivemind_privates.connect(natted, public.peer_id, [])  # its backoff is gone
        finally:
            nodes = [p for p in (public, natted, relay) if p is not None]
            await asyncio.gather(*(p.shutdown() for p in nodes), return_exceptions=True)

    asyncio.run(run())


def test_a_peer_asking_again_and_again_is_dialled_back_once_per_interval(tmp_path):
    """An attacker script: a public peer floods a NAT'd worker with requests to dial back, through the
    relay. The worker dials it once, refuses the rest, and dials nobody else."""
    async def run():
        relay, natted, relays = await _relay_and_natted()
        attacker = None
        try:
            attacker = await _joined(relays, host_maddrs=LOOPBACK, **daemon_options(False, []))
            natted_id = natted.peer_id.to_base58()
            serving = _reversal(natted, {})
            await serving.streams.listen(serving.serve)
            await _reserved(attacker, natted_id, relays)
            flood = P2PStreams(attacker, "opendiloco.test.reverse")
            answered = refused = unreached = 0
            began = time.monotonic()
            for _ in range(12):
                await dial_via(attacker, natted_id, relays, timeout=5.0)  # or the direct connection it dialled back
                try:
                    stream = await asyncio.wait_for(flood.connect(natted_id), 5)
                    await stream.send(Code.REVERSE, {})
                    await asyncio.wait_for(stream.recv(max_payload=0, expect=Code.REVERSE), 5)
                    answered += 1
                except (Refused, StreamClosed):  # refused, or cut by the worker closing the relayed connection
                    refused += 1
                except Unreachable:  # a loaded machine: the redial through the relay missed its 5 s; no request
                    unreached += 1
            elapsed = time.monotonic() - began
            assert 1 <= serving.served <= 1 + elapsed / MIN_INTERVAL_S, (serving.served, elapsed)  # one per interval
            assert answered + refused + unreached == 12 and answered <= serving.served, (answered, refused)
            assert answered + refused >= 3, (answered, refused, unreached)  # the flood did reach it
            peers = {info.peer_id for info in await natted.list_peers()}
            assert peers <= {relay.peer_id, attacker.peer_id}  # it dialled nobody else
        finally:
            nodes = [p for p in (attacker, natted, relay) if p is not None]
            await asyncio.gather(*(p.shutdown() for p in nodes), return_exceptions=True)

    asyncio.run(run())
