"""State transfer over real p2p streams (two daemons on 127.0.0.1): bounded, digest-checked downloads."""

from __future__ import annotations

import asyncio

import pytest
import torch
from hivemind.p2p import P2P

from opendiloco.comm.wire import Code
from opendiloco.errors import ProtocolError
from opendiloco.swarm.state_transfer import StateServer, fetch_state
from opendiloco.swarm.streams import P2PStreams

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(90)]


def with_two_peers(scenario):
    async def main():
        donor = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        receiver = None
        try:
            receiver = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                                        initial_peers=[str(m) for m in await donor.get_visible_maddrs()])
            return await asyncio.wait_for(scenario(donor, receiver), 60)
        finally:
            for p2p in (receiver, donor):
                if p2p is not None:
                    await p2p.shutdown()

    return asyncio.run(main())


def test_state_downloads_and_matches_the_donors():
    state = {"outer_step": 3, "inner_steps_total": 30, "outer": {"global_params": [torch.randn(1000)]}}

    async def scenario(donor, receiver):
        server = StateServer(P2PStreams(donor, "test.state"))
        server.provider = lambda: state
        await server.listen()
        return await fetch_state(P2PStreams(receiver, "test.state"), donor.peer_id.to_base58(), 2, 1 << 20)

    got = with_two_peers(scenario)
    assert got["outer_step"] == 3 and torch.equal(got["outer"]["global_params"][0], state["outer"]["global_params"][0])


def test_state_larger_than_the_model_implies_is_refused_before_it_is_read():
    state = {"outer_step": 3, "blob": torch.zeros(1 << 20)}  # 4 MiB

    async def scenario(donor, receiver):
        server = StateServer(P2PStreams(donor, "test.state"))
        server.provider = lambda: state
        await server.listen()
        with pytest.raises(ProtocolError, match="at most"):
            await fetch_state(P2PStreams(receiver, "test.state"), donor.peer_id.to_base58(), None, 1 << 20)

    with_two_peers(scenario)


def test_lying_donor_announcing_gigabytes_is_refused():
    """An attacker script as donor: it announces 1.5 GB and a digest, then sends nothing."""

    async def scenario(donor, receiver):
        async def liar(stream):
            await stream.recv(max_payload=0, expect=Code.STATE_REQUEST)
            await stream.send(Code.STATE, {"size": 1_500_000_000, "outer_step": 99, "digest": "00"})
            await asyncio.sleep(5)

        await P2PStreams(donor, "test.state").listen(liar)
        with pytest.raises(ProtocolError, match="at most"):
            await fetch_state(P2PStreams(receiver, "test.state"), donor.peer_id.to_base58(), None, 64 << 20)

    with_two_peers(scenario)


def test_state_that_does_not_match_its_digest_is_refused():
    async def scenario(donor, receiver):
        async def corrupt(stream):
            await stream.recv(max_payload=0, expect=Code.STATE_REQUEST)
            await stream.send(Code.STATE, {"size": 10, "outer_step": 1, "digest": "not-the-digest"})
            await stream.send(Code.STATE_PART, None, b"0123456789")
            await asyncio.sleep(1)

        await P2PStreams(donor, "test.state").listen(corrupt)
        with pytest.raises(ProtocolError, match="digest"):
            await fetch_state(P2PStreams(receiver, "test.state"), donor.peer_id.to_base58(), None, 1 << 20)

    with_two_peers(scenario)
