"""A joiner's download in parts from several donors, over real p2p streams (daemons on 127.0.0.1):
every part checked, a donor that dies or lies mid-part leaves its parts to the others."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal

import pytest
import torch
from hivemind.p2p import P2P

from opendiloco.comm.wire import Code
from opendiloco.errors import ProtocolError
from opendiloco.swarm.state import multi_donor
from opendiloco.swarm.state.layout import Snapshot
from opendiloco.swarm.state.multi_donor import fetch_from_donors, fetch_manifest, part_bytes_for
from opendiloco.swarm.state.transfer import CHUNK_BYTES, StateServer, fetch_state
from opendiloco.swarm.streams import P2PStreams
from tests.nested import same

from .attack_cuts import hold_cuts

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(120)]

MAX_BYTES = 1 << 30
PARTS = part_bytes_for(MAX_BYTES)


def make_state(seed: int = 0, tail: int | None = None) -> dict:
    """θ_global and momentum of 6 parts' worth; ``tail``: a donor's own Adam moments, last (a warm start's)."""
    g = torch.Generator().manual_seed(seed)
    n = 3 * PARTS // 4
    state = {"outer_step": 4, "inner_steps_total": 40, "local_step": 0,
             "outer": {"global_params": [torch.randn(n, generator=g), torch.randn(3, 5, generator=g)],
                       "optimizer": {"state": {0: {"momentum_buffer": torch.randn(n, generator=g)}},
                                     "param_groups": [{"lr": 0.4, "momentum": 0.9, "params": [0, 1]}]}}}
    if tail is not None:
        state["inner"] = {"exp_avg": torch.full((PARTS // 4,), float(tail))}
    return state


def with_donors(count: int, scenario):
    """``scenario(donors, streams)``: ``count`` donor daemons and a joiner's streams, all connected."""
    async def main():
        nodes = []
        try:
            for _ in range(count):
                nodes.append(await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"]))
            maddrs = [str(m) for node in nodes for m in await node.get_visible_maddrs()]
            joiner = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=maddrs)
            nodes.append(joiner)
            return await asyncio.wait_for(scenario(nodes[:count], P2PStreams(joiner, "test.state")), 90)
        finally:
            for node in reversed(nodes):
                try:
                    await node.shutdown()
                except Exception:  # a daemon the scenario killed
                    pass

    return asyncio.run(main())


async def serve(node: P2P, state: dict) -> StateServer:
    server = StateServer(P2PStreams(node, "test.state"))
    server.provider = lambda: state
    await server.listen()
    return server


def ids(nodes) -> list[str]:
    return [n.peer_id.to_base58() for n in nodes]


def silent_for(seconds: float):
    """A request handler for a ``StateServer`` that answers nothing for ``seconds``."""

    async def silent(stream, meta):
        await asyncio.sleep(seconds)

    return silent


def test_a_state_in_parts_from_three_donors_matches_and_each_served_some():
    state = make_state()

    async def scenario(donors, streams):
        for d in donors:
            await serve(d, state)
        return await fetch_from_donors(streams, ids(donors), 4, MAX_BYTES)

    download = with_donors(3, scenario)
    got, rates = download.state, download.rates
    assert same({k: v for k, v in got.items() if k != "donor"}, state)
    assert len(rates) == 3 and all(r > 0 for r in rates.values())
    assert sorted(download.donors) == sorted(rates)


def with_bad_donor(count: int, bad: int, behaviour, caplog):
    """``count`` donors of one state, donor ``bad`` serving its parts by ``behaviour(server, node, stream,
    meta)`` (an attacker script, or a fault); returns (the state, the download, the bad donor's id)."""
    state = make_state()

    async def scenario(donors, streams):
        servers = [await serve(d, state) for d in donors]

        async def part(stream, meta):
            await behaviour(servers[bad], donors[bad], stream, meta)

        servers[bad]._serve_part = part
        return await fetch_from_donors(streams, ids(donors), 4, MAX_BYTES), ids(donors)[bad]

    with caplog.at_level(logging.WARNING, logger="opendiloco.swarm.state.multi_donor"):
        download, peer = with_donors(count, scenario)
    assert same({k: v for k, v in download.state.items() if k != "donor"}, state)
    return download, peer


def test_a_donor_killed_mid_part_leaves_its_parts_to_the_others(caplog):
    """The third donor's daemon is SIGKILLed after the first MiB of its first part."""
    killed = []

    async def die_mid_part(server, node, stream, meta):
        await stream.send(Code.STATE_PART, None, server._cuts[-1].part(meta["index"])[:CHUNK_BYTES])
        await asyncio.sleep(0.1)
        if not killed:  # two of its parts may be asked for at once: the second finds it dead already
            killed.append(node._child.pid)
            os.kill(node._child.pid, signal.SIGKILL)

    download, victim = with_bad_donor(3, 2, die_mid_part, caplog)
    assert killed, "the victim never got a part request"
    assert victim not in download.rates and len(download.rates) == 2  # its parts came from the two others
    # Not asserted: that it was dropped by name. Its part in flight either fails (then it is dropped once
    # its failures reach the budget) or is taken over by a faster donor first and its fetch cancelled;
    # which comes first depends on the machine (a loaded clean-clone run saw the second).


def test_a_donor_whose_part_does_not_match_its_digest_is_dropped_and_named(caplog):
    """An attacker's donor: its manifest is honest, the parts it sends are not."""

    async def lie(server, node, stream, meta):
        data = bytearray(server._cuts[-1].part(meta["index"]))
        data[12345] ^= 1
        for i in range(0, len(data), CHUNK_BYTES):
            await stream.send(Code.STATE_PART, None, bytes(data[i : i + CHUNK_BYTES]))

    download, liar = with_bad_donor(3, 1, lie, caplog)
    assert liar not in download.rates
    assert f"dropped donor {liar[-8:]} ({liar[-8:]} sent part" in caplog.text


def test_parts_only_the_head_has_come_from_the_head():
    """Donors agree on θ_global and momentum but each has its own Adam moments (the last parts):
    those come from the head, whose skeleton the state is built on."""
    states = [make_state(tail=i) for i in range(3)]

    async def scenario(donors, streams):
        for d, s in zip(donors, states):
            await serve(d, s)
        manifests = [await fetch_manifest(streams, d, 4, PARTS, MAX_BYTES) for d in ids(donors)]
        got = await fetch_from_donors(streams, ids(donors), 4, MAX_BYTES)
        return manifests, got

    manifests, download = with_donors(3, scenario)
    got = download.state
    differ = [i for i, d in enumerate(manifests[0].digests) if manifests[1].digests[i] != d]
    assert differ and differ[-1] == len(manifests[0].digests) - 1  # the tail is the donors' own
    assert same({k: v for k, v in got.items() if k != "donor"}, states[0])


def test_a_donor_that_stalls_its_manifest_does_not_hold_the_download(monkeypatch):
    """One of three donors never answers its manifest request: the others serve the whole state once the
    grace after the first manifest is over, not after the manifest timeout (raised here past the test's)."""
    monkeypatch.setattr(multi_donor, "MANIFEST_TIMEOUT", 600.0)
    state = make_state()

    async def scenario(donors, streams):
        servers = [await serve(d, state) for d in donors]
        servers[0]._serve_manifest = silent_for(600)
        return await fetch_from_donors(streams, ids(donors), 4, MAX_BYTES), ids(donors)[0]

    download, staller = with_donors(3, scenario)
    assert same({k: v for k, v in download.state.items() if k != "donor"}, state)
    assert staller not in download.donors and len(download.rates) == 2


def test_a_donor_whose_manifest_comes_late_joins_the_download_under_way(monkeypatch):
    """The second donor answers its manifest only once the first has served a part, and the first crawls
    from then on: the late donor is added to the download and serves the rest."""
    monkeypatch.setattr(multi_donor, "MANIFEST_TIMEOUT", 600.0)
    state = make_state()

    async def scenario(donors, streams):
        servers = [await serve(d, state) for d in donors]
        first_part, serve_part, serve_manifest = asyncio.Event(), servers[0]._serve_part, servers[1]._serve_manifest

        async def one_then_crawl(stream, meta):
            if first_part.is_set():
                await asyncio.sleep(600)
            first_part.set()
            await serve_part(stream, meta)

        async def late(stream, meta):
            await first_part.wait()
            await serve_manifest(stream, meta)

        servers[0]._serve_part, servers[1]._serve_manifest = one_then_crawl, late
        return await fetch_from_donors(streams, ids(donors), 4, MAX_BYTES), ids(donors)[1]

    download, latecomer = with_donors(2, scenario)
    assert same({k: v for k, v in download.state.items() if k != "donor"}, state)
    assert latecomer in download.donors and latecomer in download.rates


def test_donors_that_cannot_deliver_every_part_fail_the_download_naming_them(monkeypatch):
    monkeypatch.setattr(multi_donor, "STALL_TIMEOUT", 1.0)
    state = make_state()

    async def scenario(donors, streams):
        servers = [await serve(d, state) for d in donors]
        for server in servers:
            server._serve_part = silent_for(30)
        with pytest.raises(ProtocolError, match="state parts found no donor") as e:
            await fetch_from_donors(streams, ids(donors), 4, MAX_BYTES)
        return str(e.value)

    message = with_donors(2, scenario)
    assert "sent nothing for 1s" in message


def test_donors_past_the_asked_step_say_where_they_are_and_one_behind_it_refuses():
    """The run moved on while the joiner read its records: the donors say which step they are at (the
    joiner asks again once the run confirms it, ``download_state``); one not there yet refuses."""
    ahead, behind = make_state(), {**make_state(), "outer_step": 2}

    async def scenario(donors, streams):
        await serve(donors[0], ahead)
        with pytest.raises(multi_donor.DonorsAhead) as moved:
            await fetch_from_donors(streams, ids(donors)[:1], 3, MAX_BYTES)
        await serve(donors[1], behind)
        with pytest.raises(ProtocolError, match="no donor sent a manifest of outer step 3") as mixed:
            await fetch_from_donors(streams, ids(donors), 3, MAX_BYTES)
        return moved.value.outer_step, str(mixed.value)

    step, message = with_donors(2, scenario)
    assert step == 4
    assert "is at outer step 4" in message and "at outer step 2, not yet 3" in message


def test_parts_are_served_only_of_a_cut_a_manifest_made_and_within_a_peers_budget():
    """An attacker's joiner: part requests before any manifest, then the same part over and over."""
    state = make_state()

    async def ask(streams, donor, index, digest="00"):
        stream = await streams.connect(donor)
        try:
            await stream.send(Code.STATE_PART_REQUEST, {"outer_step": 4, "part_bytes": PARTS, "index": index,
                                                        "digest": digest})
            got = 0
            while got < PARTS:
                got += len((await stream.recv(max_payload=CHUNK_BYTES, expect=Code.STATE_PART)).payload)
            return got
        finally:
            stream.close()

    async def scenario(donors, streams):
        server = await serve(donors[0], state)
        donor = ids(donors)[0]
        with pytest.raises(ProtocolError, match="no cut of outer step 4 with that part 0 here"):
            await ask(streams, donor, 0)
        assert not server._cuts  # a part request never cuts the state
        manifest = await fetch_manifest(streams, donor, 4, PARTS, MAX_BYTES)
        with pytest.raises(ProtocolError, match="no part 99"):
            await ask(streams, donor, 99)
        with pytest.raises(ProtocolError, match="no cut of outer step 4 with that part 0 here"):
            await ask(streams, donor, 0, digest=manifest.digests[1].hex())  # another part's digest
        served = 0
        with pytest.raises(ProtocolError, match="at most 3x the state in parts per peer"):
            while True:
                served += await ask(streams, donor, 0, digest=manifest.digests[0].hex())
        return served, manifest.size

    served, size = with_donors(1, scenario)
    assert 2 * size < served <= 3 * size


def test_a_later_joiner_gets_a_fresh_cut_and_an_earlier_ones_parts_are_still_served(monkeypatch):
    """The donor moves on within the outer step (its position in the round, its Adam moments): a manifest
    asked for later is of the state as it is then, and a download of the cut before goes on."""
    from opendiloco.swarm.state import transfer as state_transfer

    monkeypatch.setattr(state_transfer, "SNAPSHOT_FRESH_S", 0.0)
    states = [make_state(tail=0), make_state(tail=1)]
    states[1]["local_step"] = 7

    async def scenario(donors, streams):
        server = await serve(donors[0], states[0])
        donor = ids(donors)[0]
        first = await fetch_manifest(streams, donor, 4, PARTS, MAX_BYTES)
        server.provider = lambda: states[1]
        second = await fetch_manifest(streams, donor, 4, PARTS, MAX_BYTES)
        old_tail = await multi_donor.fetch_part(streams, donor, first, len(first.digests) - 1)
        return first, second, old_tail, len(server._cuts)

    first, second, old_tail, kept = with_donors(1, scenario)
    assert (first.skeleton["local_step"], second.skeleton["local_step"]) == (0, 7)
    differ = [i for i, d in enumerate(first.digests) if second.digests[i] != d]
    assert differ and differ == list(range(differ[0], len(first.digests)))  # the tail only: the moments
    assert len(old_tail) == first.part_size(len(first.digests) - 1) and kept == 2


def test_an_idle_donor_races_a_slow_one_for_its_parts_instead_of_waiting_it_out(caplog):
    """The second donor takes each part request and then sends nothing for a minute (a dead-slow link,
    not yet a stalled one): the first takes those parts over once they take longer than its own do."""

    async def crawl(server, node, stream, meta):
        await asyncio.sleep(60)

    download, slow = with_bad_donor(2, 1, crawl, caplog)
    assert slow not in download.rates
    assert "dropped donor" not in caplog.text  # raced, not timed out (20 s) and dropped


def test_a_joiner_is_counted_as_coming_from_its_request_and_again_once_it_has_the_state():
    """A donor's rounds wait for a joiner from its manifest request (a round due while it downloads waits
    for it, or a worker catching up would miss the round it caught up for), and from its word that it has
    the state (a long download outlasts the window counted from the request). Only for the step asked."""
    state = make_state()

    async def scenario(donors, streams):
        server = await serve(donors[0], state)
        donor, me = ids(donors)[0], streams.p2p.peer_id.to_base58()
        seen = []
        await fetch_manifest(streams, donor, 4, PARTS, MAX_BYTES)
        seen.append(server.joiners[me])
        await multi_donor.tell_done(streams, (donor,), 3)  # another step than it asked for: ignored
        await asyncio.sleep(0.3)
        seen.append(server.joiners[me])
        await multi_donor.tell_done(streams, (donor,), 4)
        for _ in range(100):  # the donor takes the word when its stream arrives
            if server.joiners[me] != seen[-1]:
                break
            await asyncio.sleep(0.01)
        seen.append(server.joiners[me])
        return seen, me in server.recent_joiners(4, within=60)

    (asked, wrong_step, done), counted = with_donors(1, scenario)
    assert asked[0] == wrong_step[0] == done[0] == 4 and counted
    assert wrong_step[1] == asked[1] < done[1]


def test_a_whole_download_counts_its_joiner_from_its_request():
    state = make_state()

    async def scenario(donors, streams):
        server = await serve(donors[0], state)
        me = streams.p2p.peer_id.to_base58()
        before = me in server.recent_joiners(4, within=60)
        await fetch_state(streams, ids(donors)[0], None, MAX_BYTES)
        return before, me in server.recent_joiners(4, within=60)

    assert with_donors(1, scenario) == (False, True)


def test_telling_a_dead_donor_is_quiet(caplog):
    """A donor that died after serving its parts: telling it the state was taken fails quietly (its error
    is collected, never logged as an exception nobody retrieved)."""
    import gc

    async def scenario(donors, streams):
        await donors[0].shutdown()
        await multi_donor.tell_done(streams, tuple(ids(donors)), 4, timeout=5.0)
        gc.collect()
        await asyncio.sleep(0.1)

    with caplog.at_level(logging.ERROR, logger="asyncio"):
        with_donors(1, scenario)
    assert "never retrieved" not in caplog.text


def _alive_cuts() -> int:
    """Cuts of a state alive in this process (kept by a donor, or held by what it is sending)."""
    gc.collect()
    return sum(isinstance(o, Snapshot) for o in gc.get_objects())


@pytest.mark.parametrize("fresh_s", [60.0, 0.0])
def test_identities_that_ask_manifests_and_read_slowly_make_a_donor_hold_at_most_two_cuts(monkeypatch, fresh_s):
    """``attack_cuts.py`` from 3 identities, each asking its own part size and never reading its parts:
    the donor cuts its state once per fresh manifest whatever part size is asked, and holds at most
    ``MAX_CUTS_HELD`` cuts however many slow readers hold parts (with ``fresh_s`` 0 each manifest
    would be a fresh cut)."""
    from opendiloco.swarm.state import transfer as state_transfer

    monkeypatch.setattr(state_transfer, "SNAPSHOT_FRESH_S", fresh_s)
    state = make_state()
    state["outer"]["global_params"][0] = torch.randn(6 * PARTS)  # a part the streams cannot buffer whole

    async def main():
        nodes, held = [], []
        try:
            nodes.append(await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"]))
            server = await serve(nodes[0], state)
            maddrs = [str(m) for m in await nodes[0].get_visible_maddrs()]
            reports, peak = [], 0
            for i in range(3):
                nodes.append(await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=maddrs))
                reports.append(await hold_cuts(P2PStreams(nodes[-1], "test.state"), ids(nodes)[0], 4,
                                               [(16 + 8 * i) << 20], held))
                await asyncio.sleep(0.2)  # the donor starts its sends
                peak = max(peak, _alive_cuts())
            return server.cuts_made, peak, reports
        finally:
            for stream in held:
                stream.close()
            for node in reversed(nodes):
                await node.shutdown()

    made, peak, reports = asyncio.run(asyncio.wait_for(main(), 90))
    print(f"fresh_s {fresh_s}: cuts made {made}, peak alive {peak}, {reports}")
    assert peak <= state_transfer.MAX_CUTS_HELD  # before: 3 either way (one cut per identity, all held)
    if fresh_s:
        assert made == 1  # before: 3 (each part size asked a cut of its own)
