"""Relays for workers behind NAT (``opendiloco.swarm.connectivity.relays``): what a record may name, how a circuit
address is written for the p2p daemon, and the daemon flags each kind of node gets."""

from __future__ import annotations

import msgpack
import pytest
from hivemind.p2p import P2P, PeerID
from hivemind.utils.multiaddr import Multiaddr

from opendiloco.swarm.connectivity import relays
from opendiloco.swarm.records import WorkerRecord

RELAY_ID = "12D3KooWDP4cZTWaMqpXBYJBXSpnWUTwcJX76gA9HqczfujpXRqb"
RELAY = f"/ip4/198.51.100.7/tcp/31337/p2p/{RELAY_ID}"


def test_a_circuit_address_names_the_relay_as_a_bare_multihash():
    """The daemon reads ``/p2p/ID`` as a bare multihash; hivemind's multiaddr library writes a CID there,
    which the daemon refuses ("length greater than remaining number of bytes in buffer")."""
    raw = relays.circuit_address(RELAY).to_bytes()
    multihash = PeerID.from_base58(RELAY_ID).to_bytes()
    head = Multiaddr("/ip4/198.51.100.7/tcp/31337").to_bytes()
    assert raw == head + b"\xa5\x03" + bytes([len(multihash)]) + multihash + b"\xa2\x02"
    assert Multiaddr(RELAY).to_bytes() != head + b"\xa5\x03" + bytes([len(multihash)]) + multihash


@pytest.mark.parametrize("bad", [
    "/ip4/198.51.100.7/tcp/31337",                                      # no peer id
    f"/ip4/198.51.100.7/tcp/31337/p2p/{RELAY_ID}/p2p-circuit",           # already a circuit
    f"/p2p/{RELAY_ID}",                                                 # no transport
    "/ip4/198.51.100.7/tcp/31337/p2p/not-a-peer-id",
    f"/ip9/1.2.3.4/tcp/1/p2p/{RELAY_ID}",
])
def test_a_relay_address_without_transport_and_peer_id_is_refused(bad):
    with pytest.raises(ValueError, match="not a relay's address"):
        relays.circuit_address(bad)
    assert relays.checked_relays([bad]) is None


def test_a_record_names_at_most_a_few_well_formed_relays():
    rec = WorkerRecord(peer_id="p", outer_step=3, relays=(RELAY,))
    wire = msgpack.unpackb(msgpack.packb(rec.to_value()))  # as it travels: a list
    assert WorkerRecord.from_value("p", wire).relays == (RELAY,)
    assert WorkerRecord.from_value("p", {**wire, "relays": []}).relays == ()
    assert WorkerRecord.from_value("p", {k: v for k, v in wire.items() if k != "relays"}).relays == ()
    for bad in ([RELAY] * (relays.MAX_RELAYS + 1), RELAY, [7], ["/ip4/1.2.3.4/tcp/1/p2p/" + "x" * 300],
                ["/ip4/198.51.100.7/tcp/31337"], {"a": RELAY}):
        assert WorkerRecord.from_value("p", {**wire, "relays": bad}) is None, bad


def test_the_relay_book_keeps_each_peers_latest_relays():
    book = relays.RelayBook()
    book.note("a", (RELAY,))
    assert book.of("a") == (RELAY,) and book.of("b") == ()
    book.note("a", ())
    assert book.of("a") == ()


def test_a_public_node_relays_and_a_client_node_reserves_on_its_relays_only():
    assert relays.daemon_options(False, [RELAY]) == {"force_reachability": "public"}
    assert relays.daemon_options(True, [RELAY]) == {"force_reachability": "private", "use_auto_relay": True,
                                                    "trusted_relays": [RELAY]}
    assert relays.daemon_options(True, []) == {"force_reachability": "private", "use_auto_relay": False}
    # No more than a record may name, one address per peer, only what a record may name.
    ids = [str(PeerID(bytes([0, 36, 8, 1, 18, 32]) + bytes([i]) * 32)) for i in range(relays.MAX_RELAYS + 3)]
    many = [f"/ip4/198.51.100.{i}/tcp/31337/p2p/{peer}" for i, peer in enumerate(ids)]
    assert relays.daemon_options(True, many)["trusted_relays"] == many[:relays.MAX_RELAYS]
    same_peer = [RELAY, RELAY.replace("198.51.100.7", "198.51.100.8"), "/ip4/1.2.3.4/tcp/1", many[0]]
    assert relays.daemon_options(True, same_peer)["trusted_relays"] == [RELAY, many[0]]
    # Given relays, the daemon uses them and no discovery (which waits for 4 candidates or 3 minutes).
    args = P2P._make_process_args("p2pd", autoRelay=True, trustedRelays=RELAY)
    assert "-relayDiscovery=0" in args and f"-trustedRelays={RELAY}" in args
    assert not any(a.startswith("-relayDiscovery") for a in P2P._make_process_args("p2pd", autoRelay=False))


def test_holds_are_bounded_per_peer_and_end_with_their_stream():
    """A peer (or an attacker with many identities) cannot keep more than a few idle streams open here;
    a hold that sends anything, or whose dialler closes it, ends and frees its place."""
    import asyncio

    from opendiloco.comm.wire import Code, memory_pipe

    async def scenario():
        links = relays.RelayLinks(relays.RelayBook(), p2p=None, open_hold=None)
        served, theirs = [], []

        def hold_from(peer):
            mine, srv = memory_pipe(peer, "me")
            task = asyncio.create_task(links.serve_hold(srv))
            served.append(task)
            theirs.append(mine)
            return task

        first = [hold_from("attacker") for _ in range(relays.MAX_HOLDS_PER_PEER)]
        extra = hold_from("attacker")
        await asyncio.wait_for(extra, 1.0)  # refused at once
        await asyncio.sleep(0.05)
        assert not any(t.done() for t in first) and links._serving == {"attacker": relays.MAX_HOLDS_PER_PEER}
        other = hold_from("honest")
        await asyncio.sleep(0.05)
        assert not other.done()
        await theirs[0].send(Code.HELLO, {})  # a hold carries nothing: a frame ends it
        theirs[-1].close()                    # and so does its dialler closing it
        await asyncio.wait_for(asyncio.gather(first[0], other), 1.0)
        assert links._serving == {"attacker": relays.MAX_HOLDS_PER_PEER - 1}
        for stream in theirs:
            stream.close()
        await asyncio.wait_for(asyncio.gather(*served), 1.0)
        assert links._serving == {}

    asyncio.run(scenario())
