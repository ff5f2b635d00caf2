"""State transfer over real p2p streams (two daemons on 127.0.0.1): bounded, digest-checked downloads."""

from __future__ import annotations

import asyncio

import pytest
import torch
from hivemind.p2p import P2P

from opendiloco import DiLoCoOptimizer, SingleWorker
from opendiloco.comm.wire import Code
from opendiloco.errors import ProtocolError
from opendiloco.swarm.state import transfer as state_transfer
from opendiloco.swarm.state.transfer import StateServer, download_bound, fetch_state, own_check
from opendiloco.swarm.streams import P2PStreams
from tests.swarm.bad_donor import poison

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


async def gigabyte_liar(stream):
    """An attacker script as donor: it announces 1.5 GB and a digest, then sends nothing."""
    await stream.recv(max_payload=0, expect=Code.STATE_REQUEST)
    await stream.send(Code.STATE, {"size": 1_500_000_000, "outer_step": 99, "digest": "00"})
    await asyncio.sleep(5)


def test_lying_donor_announcing_gigabytes_is_refused():
    async def scenario(donor, receiver):
        await P2PStreams(donor, "test.state").listen(gigabyte_liar)
        with pytest.raises(ProtocolError, match="at most"):
            await fetch_state(P2PStreams(receiver, "test.state"), donor.peer_id.to_base58(), None, 64 << 20)

    with_two_peers(scenario)


def test_a_donor_that_never_starts_sending_is_given_up_on(monkeypatch):
    """An attacker script as donor: it takes the request and answers nothing (it used to hold the
    download for as long as the stream stayed open)."""
    monkeypatch.setattr(state_transfer, "head_timeout", lambda max_bytes: 1.0)

    async def scenario(donor, receiver):
        async def silent(stream):
            await stream.recv(max_payload=0, expect=Code.STATE_REQUEST)
            await asyncio.sleep(120)

        await P2PStreams(donor, "test.state").listen(silent)
        with pytest.raises(ProtocolError, match="sent nothing for 1s"):
            await fetch_state(P2PStreams(receiver, "test.state"), donor.peer_id.to_base58(), None, 1 << 20)

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


class ServedBy(SingleWorker):
    """A lone worker whose state provider goes to ``server``, as ``SwarmCommunicator`` attaches it."""

    def __init__(self, server: StateServer):
        super().__init__()
        self.server = server

    def attach_state_provider(self, provider) -> None:
        self.server.provider = provider


def worker(server: StateServer | None = None, outer_steps: int = 0) -> DiLoCoOptimizer:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = DiLoCoOptimizer(model.parameters(), local_steps=2, communicator=ServedBy(server) if server else None)
    for _ in range(2 * outer_steps):
        model(torch.randn(4, 8)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return opt


def test_a_workers_own_bound_caps_every_download_whatever_the_caller_passed():
    """The library's download bound is the model's: a caller that passes none, or 64 GiB, is held to the
    bound of the optimizer attached to this worker (``download_bound``, what the communicator uses)."""

    async def scenario(donor, receiver):
        await P2PStreams(donor, "test.state").listen(gigabyte_liar)
        streams = P2PStreams(receiver, "test.state")
        server = StateServer(streams)
        own = worker(server)
        assert download_bound(None, server.provider) == download_bound(64 << 30, server.provider) \
            == own.shareable_state_bound() < 1_500_000_000
        with pytest.raises(ProtocolError, match=f"at most {own.shareable_state_bound()} accepted"):
            await fetch_state(streams, donor.peer_id.to_base58(), None, download_bound(64 << 30, server.provider))

    with_two_peers(scenario)


def test_a_state_the_worker_would_refuse_is_refused_at_download_naming_the_donor(caplog):
    """So that the caller goes on to its next donor. The state handed over names its donor (set by the
    receiver), and never a ``confirmed_hash`` of the donor's own."""
    honest = worker(outer_steps=2).shareable_state()
    honest["confirmed_hash"] = "the donor's own word"
    states = [poison(worker(outer_steps=2).shareable_state(), "lr"), honest]

    async def scenario(donor, receiver):
        server = StateServer(P2PStreams(donor, "test.state"))
        server.provider = lambda: states.pop(0)
        await server.listen()
        streams = P2PStreams(receiver, "test.state")
        own = StateServer(streams)
        worker(own)
        check = own_check(own.provider)
        name = donor.peer_id.to_base58()
        refused = f"refused the state of donor {name[-8:]}: outer optimizer setting 'lr'"
        with pytest.raises(ProtocolError, match=refused):
            await fetch_state(streams, name, None, 1 << 20, check)
        return name, await fetch_state(streams, name, None, 1 << 20, check)

    name, got = with_two_peers(scenario)
    assert got["donor"] == name and "confirmed_hash" not in got and got["outer_step"] == 2
    refusals = [r for r in caplog.records if "refused the state of donor" in r.getMessage()]
    assert len(refusals) == 1 and "\n" not in refusals[0].getMessage()
