"""A worker behind NAT keeps its relay slots itself (``swarm/connectivity/reservations.py``), over real p2p daemons
on 127.0.0.1: a relay that restarts, a node behind NAT (listening nowhere) and a public node that reaches
it only through the relay.

hivemind 1.1.12's daemon did not reserve again on a relay that restarted (not in a minute here, not
in the world scenarios' minutes): the NAT'd node stayed out of reach through it.
"""

from __future__ import annotations

import asyncio
import signal
import time

import pytest
from hivemind.p2p import P2P

from opendiloco.swarm.connectivity.relays import close_connections, daemon_options, dial_via, uvarint
from opendiloco.swarm.connectivity.reservations import (
    RESERVE,
    STATUS_OK,
    RelaySlots,
    answer_status,
    ping,
    relay_address,
    relay_ids,
    reserve,
    widen,
)
from opendiloco.swarm.records import WorkerRecord
from opendiloco.testing.ports import free_port
from tests.swarm.test_reversal import _joined, _reserved

pytestmark = pytest.mark.timeout(120)

PEER = "12D3KooWJbER3pdJS7sBKAQtLHiLbkUSp4a6E6wobNQYbdv5jWxy"


def _relay_identity(tmp_path) -> tuple[str, str]:
    """A relay's key file and fixed address, so that it can start again as the same peer at the same place."""
    key, addr = str(tmp_path / "relay.key"), f"/ip4/127.0.0.1/tcp/{free_port()}"
    P2P.generate_identity(key)
    return key, addr


async def _start_relay(key: str, addr: str, again: bool = False) -> P2P:
    return await P2P.create(host_maddrs=[addr], identity_path=key, check_if_identity_free=not again,
                            **daemon_options(False, []))


async def _behind_nat(nodes: list) -> tuple[list[str], P2P]:
    """The relay's (``nodes[0]``) addresses, and a client-mode node with a slot on it (added to ``nodes``)."""
    first = [str(a) for a in await nodes[0].get_visible_maddrs()]
    natted = await _joined(first, host_maddrs=[], **daemon_options(True, first))
    nodes.append(natted)
    return first, natted


def _watched(natted: P2P, relays: list[str]):
    """``RelaySlots.watch`` over ``relays`` at 5 looks a second: (the slots, the moves it reports, its task)."""
    moves: list[str] = []
    slots = RelaySlots(natted, relays, every=3600)
    slots.on_moved = moves.append
    return slots, moves, asyncio.ensure_future(slots.watch(every=0.2))


@pytest.mark.swarm
@pytest.mark.parametrize("renew", [False, True], ids=["daemon-alone", "renewed"])
def test_a_worker_behind_nat_is_reached_through_a_relay_that_restarted(renew, tmp_path):
    async def run():
        key, addr = _relay_identity(tmp_path)
        nodes = [relay := await _start_relay(key, addr)]
        try:
            first, natted = await _behind_nat(nodes)
            public = await _joined(first, host_maddrs=["/ip4/127.0.0.1/tcp/0"], **daemon_options(False, []))
            nodes.append(public)
            natted_id, relay_id = natted.peer_id.to_base58(), relay.peer_id.to_base58()
            await _reserved(public, natted_id, first)  # the daemon's own slot, taken at start
            await relay.shutdown()  # every slot it held is gone with it
            relay = nodes[0] = await _start_relay(key, addr, again=True)
            if not renew:
                assert not await dial_via(public, natted_id, first, timeout=5.0)
                return
            for _ in range(20):  # the NAT'd node may need a moment to dial the new relay
                if await reserve(natted, relay_id):
                    break
                await asyncio.sleep(0.5)
            else:
                raise AssertionError("the restarted relay gave no slot")
            assert await dial_via(public, natted_id, first, timeout=5.0)
        finally:
            await asyncio.gather(*(p.shutdown() for p in nodes), return_exceptions=True)

    asyncio.run(run())


@pytest.mark.swarm
def test_a_relay_back_from_a_restart_is_reported_once_it_holds_the_slot_again(tmp_path):
    """``on_slot_back`` tells the worker when a relay that gave no slot gives one again: the workers behind
    NAT it could not dial while the relay was down are tried again then (``ConnectivityWatch.on_slot_back``)."""
    async def run():
        key, addr = _relay_identity(tmp_path)
        nodes = [relay := await _start_relay(key, addr)]
        try:
            first, natted = await _behind_nat(nodes)
            relay_id, back = relay.peer_id.to_base58(), []
            slots = RelaySlots(natted, first, every=3600)
            slots.on_slot_back = back.append
            keeping = asyncio.ensure_future(slots.keep())
            try:
                async def until(what, why):
                    for _ in range(600):
                        if what():
                            return
                        assert not keeping.done(), keeping
                        await asyncio.sleep(0.1)
                    raise AssertionError(why)

                await until(lambda: slots.held.get(relay_id) is True, "no slot at start")
                await relay.shutdown()
                slots.renew_soon()
                await until(lambda: slots.held.get(relay_id) is False, "a relay that is down gave a slot")
                assert back == []
                relay = nodes[0] = await _start_relay(key, addr, again=True)
                await until(lambda: back, "the relay's return was not reported")
                assert back == [relay_id] and slots.held == {relay_id: True}
            finally:
                keeping.cancel()
        finally:
            await asyncio.gather(*(p.shutdown() for p in nodes), return_exceptions=True)

    asyncio.run(asyncio.wait_for(run(), 110))


@pytest.mark.swarm
def test_a_relay_that_gives_no_slot_is_asked_again_soon():
    """Slots are asked for every ``every`` seconds (an hour here), and every ``RETRY_S`` while a relay
    gives none: here one that is down."""
    async def run():
        node = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], **daemon_options(False, []))
        try:
            down = f"/ip4/127.0.0.1/tcp/{free_port()}/p2p/{PEER}"
            slots = RelaySlots(node, [down], every=3600)
            keeping = asyncio.ensure_future(slots.keep())
            try:
                while slots.asked < 2:
                    assert not keeping.done(), keeping
                    await asyncio.sleep(0.1)
            finally:
                keeping.cancel()
            assert slots.held == {PEER: False}
        finally:
            await node.shutdown()

    asyncio.run(asyncio.wait_for(run(), 60))


@pytest.mark.swarm
@pytest.mark.parametrize("own", [None, "renew", "closing"],
                         ids=["broken-from-outside", "closed-by-itself", "a-member-given-up-on"])
def test_a_worker_behind_nat_sees_its_connection_to_its_relay_break_and_takes_it_for_a_move(own, tmp_path):
    """A router that changes its address forgets its mappings: the NAT'd worker's next packet on a
    connection is answered with a reset. Here the relay closes its end instead (loopback has no router to
    re-address; the NAT'd node sees the same: its connection to the relay is gone while the relay is up).
    ``watch`` gets a slot on a new connection at once and reports a move, unless the worker had just
    closed its connections itself (``renew_soon``: its own cut-off or move; ``closing``: the relay is also
    a member it gave up on; a frozen member is dialled anew this way, which took it for a move once)."""
    async def run():
        relay = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], **daemon_options(False, []))
        nodes = [relay]
        try:
            first, natted = await _behind_nat(nodes)
            natted_id, relay_id = natted.peer_id.to_base58(), relay.peer_id.to_base58()
            assert await ping(natted, relay_id) is True
            slots, moves, watching = _watched(natted, first)
            try:
                await asyncio.sleep(1.0)  # it has seen the connection
                assert moves == []  # a healthy connection is no move
                if own == "renew":
                    slots.renew_soon()
                if own == "closing":
                    slots.closing({relay_id, "some-other-peer"})
                    await close_connections(natted, relay_id)
                else:
                    await close_connections(relay, natted_id)
                # Until the watch has asked the relay for a slot again (two asks of up to RESERVE_TIMEOUT
                # each on a busy machine: it took more than 10 s in a loaded run).
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline:
                    if slots.held.get(relay_id) and moves or own and slots.held.get(relay_id):
                        break
                    await asyncio.sleep(0.1)
                await asyncio.sleep(1.0)  # nothing more comes
            finally:
                watching.cancel()
            assert slots.held == {relay_id: True}, slots.held  # a slot on the new connection
            assert moves == ([] if own else [relay_id])
            public = await _joined(first, host_maddrs=["/ip4/127.0.0.1/tcp/0"], **daemon_options(False, []))
            nodes.append(public)
            assert await dial_via(public, natted_id, first, timeout=5.0)  # reached through it again
        finally:
            await asyncio.gather(*(p.shutdown() for p in nodes), return_exceptions=True)

    asyncio.run(asyncio.wait_for(run(), 90))


def test_a_relay_answer_is_read_as_protobuf_and_bounded():
    ok = b"\x08\x02" + b"\x28" + uvarint(STATUS_OK) + b"\x1a\x03abc"  # STATUS, status OK, a reservation
    assert answer_status(ok) == STATUS_OK
    assert answer_status(b"\x08\x02\x28" + uvarint(200)) == 200  # refused
    assert answer_status(RESERVE) is None  # no status at all
    for garbage in (b"\x1a\x09abc", b"\x28", b"\x29\x00\x00\x00\x00\x00\x00\x00\x00", b"\xff" * 11):
        with pytest.raises(ValueError):
            answer_status(garbage)


def test_the_relays_of_a_record_are_named_by_peer_id():
    assert relay_ids([f"/ip4/10.0.0.1/tcp/1/p2p/{PEER}", "/ip4/10.0.0.2/tcp/1"]) == [PEER]


@pytest.mark.swarm
def test_a_relay_that_froze_and_thawed_is_no_move():
    """A relay that froze (its daemon stopped) leaves the NAT'd worker's pings unanswered; thawed, its
    connection to the worker breaks: that relay's hiccup, not the worker's router (in the long world
    scenario both NAT'd workers took a relay's thaw for their own move, their peers closed every
    connection to them, and the round failed for all twelve). A connection that echoed until it broke is
    a move, as before (the other relay here)."""
    async def run():
        relays = [await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], **daemon_options(False, [])) for _ in range(2)]
        nodes = list(relays)
        try:
            addrs = [str(a) for r in relays for a in await r.get_visible_maddrs()]
            natted = await _joined(addrs, host_maddrs=[], **daemon_options(True, addrs))
            nodes.append(natted)
            natted_id, ids = natted.peer_id.to_base58(), [r.peer_id.to_base58() for r in relays]
            assert [await ping(natted, i) for i in ids] == [True, True]
            slots, moves, watching = _watched(natted, addrs)
            try:
                await asyncio.sleep(1.0)  # it has seen both connections
                daemon = relays[0]._child
                daemon.send_signal(signal.SIGSTOP)  # the first relay freezes
                try:
                    for _ in range(100):  # until a ping of it went unanswered
                        if ids[0] in slots._silent_at:
                            break
                        await asyncio.sleep(0.1)
                finally:
                    daemon.send_signal(signal.SIGCONT)
                assert ids[0] in slots._silent_at
                await close_connections(relays[0], natted_id)  # thawed: its connection broke
                for _ in range(100):
                    if slots.held.get(ids[0]) and ids[0] in {i.peer_id.to_base58() for i in await natted.list_peers()}:
                        break
                    await asyncio.sleep(0.1)
                await asyncio.sleep(1.5)
                hiccup = list(moves)
                await close_connections(relays[1], natted_id)  # a connection that echoed until it broke
                for _ in range(100):
                    if moves != hiccup:
                        break
                    await asyncio.sleep(0.1)
                await asyncio.sleep(1.0)  # nothing more comes
            finally:
                watching.cancel()
            assert slots.held == {i: True for i in ids}, slots.held
            assert hiccup == []
            assert moves == [ids[1]], moves
        finally:
            await asyncio.gather(*(p.shutdown() for p in nodes), return_exceptions=True)

    asyncio.run(asyncio.wait_for(run(), 90))


def test_a_relay_is_named_by_an_address_other_workers_can_dial():
    assert relay_address(PEER, ["/ip4/127.0.0.1/tcp/31337", "/ip4/10.0.0.2/tcp/31337"]) == \
        f"/ip4/10.0.0.2/tcp/31337/p2p/{PEER}"  # loopback last
    assert relay_address(PEER, ["/ip4/127.0.0.1/tcp/1"]) == f"/ip4/127.0.0.1/tcp/1/p2p/{PEER}"  # all it has
    assert relay_address(PEER, []) is None
    assert relay_address("not-a-peer-id", ["/ip4/10.0.0.2/tcp/1"]) is None


@pytest.mark.swarm
def test_a_worker_behind_nat_holds_slots_on_the_runs_public_workers_too():
    """Started with one initial peer, a worker behind NAT holds one relay: when that peer is down, no
    other worker behind NAT reaches it. ``widen`` takes a slot on a public worker of the run (a record
    that names addresses and no relays) and names it; one that leaves the run is forgotten, the initial
    relay never is. A public peer then reaches the NAT'd node through the adopted relay alone."""
    async def run():
        relay = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], **daemon_options(False, []))
        nodes = [relay]
        try:
            first, natted = await _behind_nat(nodes)
            public = await _joined(first, host_maddrs=["/ip4/127.0.0.1/tcp/0"], **daemon_options(False, []))
            nodes.append(public)
            me, public_id = natted.peer_id.to_base58(), public.peer_id.to_base58()
            addrs = tuple(str(a).rsplit("/p2p/", 1)[0] for a in await public.get_visible_maddrs())
            slots = RelaySlots(natted, first, every=3600)
            initial = slots.named()
            natted_peer = WorkerRecord(me, relays=initial)  # another NAT'd worker's record: no relay of it
            workers = {public_id: WorkerRecord(public_id, addrs=addrs), "12D3KooWother": natted_peer}
            assert await widen(slots, me, workers)
            assert slots.named() == initial + (relay_address(public_id, addrs),)
            assert not await widen(slots, me, workers)  # nothing new
            third = await _joined(first, host_maddrs=["/ip4/127.0.0.1/tcp/0"], **daemon_options(False, []))
            nodes.append(third)
            await relay.shutdown()  # the initial relay is gone: reached through the adopted one
            assert await dial_via(third, me, [relay_address(public_id, addrs)], timeout=10.0)
            assert await widen(slots, me, {})  # the public worker left the run
            assert slots.named() == initial
        finally:
            await asyncio.gather(*(p.shutdown() for p in nodes), return_exceptions=True)

    asyncio.run(asyncio.wait_for(run(), 90))
