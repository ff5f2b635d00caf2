"""What a retry does after a failed attempt, over real communicators on 127.0.0.1 (the failure is
injected through the communicator's hooks).

A round that failed is tried again at the same key with attempt numbers not used before. When a try
of a round fails (every attempt), the outer step does not move and the next try averages under the
same round key. Its attempts used to start at 0 again: the same members then formed a group
with the id of the attempt they had already ended, and each refused the other's streams ("round ...
is already finished"), try after try. In the world scenario with a killed bootstrap (two workers behind
NAT that lost their only relay), rounds kept failing that way for minutes after the relay was back.

A member that could not dial another behind NAT at all (``errors.Unreachable``) keeps it apart for a
few outer steps: in that scenario, every attempt of every round held both workers behind NAT, and every
one failed on their dial to each other for as long as their relay was gone (the whole run, once it
died).
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time

import pytest
import torch

from opendiloco.comm.base import RoundKey
from opendiloco.comm.group import Group
from opendiloco.comm.runner import RoundRunner
from opendiloco.errors import AveragingError, BehindError, Unreachable
from opendiloco.swarm.communicator import SwarmCommunicator
from opendiloco.swarm.connectivity.reservations import RelaySlots
from opendiloco.swarm.daemon.node import start_dht
from opendiloco.swarm.hooks import RoundHooks
from opendiloco.swarm.settings import SwarmSettings
from opendiloco.swarm.streams import P2PStreams
from tests.conftest import run_in_threads

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(150)]

SETTINGS = SwarmSettings(run_id="retry", min_group_size=2, max_attempts=1, straggler_wait=30.0,
                         matchmaking_timeout=60.0, allreduce_timeout=20.0, heartbeat_interval=1.0, record_ttl=30.0,
                         verify_timeout=3.0)


class BrokenLink(RoundRunner):
    """An exchange that fails once its round is registered (as a link that breaks at once would)."""

    async def run(self, connect):
        raise AveragingError("the link broke")


class BreakFirstTry(RoundHooks):
    def __init__(self):
        self.attempts: list[str] = []
        self.errors: list[str] = []

    def runner_for(self, group, default):
        return BrokenLink if not self.attempts else default

    def attempt_ended(self, group, error):
        self.attempts.append(group.group_id)
        self.errors.append("" if error is None else str(error))


@pytest.fixture
def workers():
    """Starts n communicators that join one run (each on its own DHT node, the first the others' peer)."""
    first, comms = None, []

    def start(n: int, settings: SwarmSettings = SETTINGS, behind_nat: int = 0) -> list[SwarmCommunicator]:
        """The last ``behind_nat`` in client mode, the first one their relay."""
        nonlocal first
        first = start_dht(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        peers = [str(m) for m in first.get_visible_maddrs()]
        comms.append(SwarmCommunicator(first, settings, own_dht=False))
        for i in range(1, n):  # each closes its own DHT node with it
            dht = start_dht(initial_peers=peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"], client_mode=i >= n - behind_nat)
            comms.append(SwarmCommunicator(dht, settings))
        deadline = time.monotonic() + 60  # every one sees the others (and waits for them in its first round)
        while not all(len(comm.live_workers()) == n for comm in comms):
            assert time.monotonic() < deadline, [len(comm.live_workers()) for comm in comms]
            time.sleep(0.2)
        return comms

    try:
        yield start
    finally:
        for comm in comms:
            comm.close()
        if first is not None:
            first.shutdown()


def together(comms, key):
    """Starts the round on every worker at once; their results or errors."""

    def run(i):
        try:
            return comms[i].start(torch.full((64,), float(i + 1)), weight=1.0, key=key).wait(90)
        except AveragingError as e:
            return e

    return run_in_threads([lambda i=i: run(i) for i in range(len(comms))], timeout=120)


def test_a_round_tried_again_at_the_same_key_uses_attempts_it_has_not_used(workers):
    pair = workers(2)
    hooks = [BreakFirstTry(), BreakFirstTry()]
    for comm, h in zip(pair, hooks):
        comm.hooks = h
    key = RoundKey(0)
    first = together(pair, key)
    assert all(isinstance(r, AveragingError) and "the link broke" in str(r) for r in first), first
    second = together(pair, key)  # the same key: the outer step did not move
    assert not any("already finished" in str(r) for r in second), (second, [h.errors for h in hooks])
    done = [r for r in second if not isinstance(r, Exception)]
    assert done, (second, [h.errors for h in hooks])
    for r in done:
        assert sorted(r.peers) == sorted(c.peer_id for c in pair)
        assert torch.allclose(r.flat, torch.full((64,), 1.5))
    for h in hooks:  # the retry is a new group id (the same members, a new attempt number)
        assert len(h.attempts) >= 2 and h.attempts[0] not in h.attempts[1:], h.attempts


class NoLinkBetween(RoundHooks):
    """This worker cannot dial ``other`` (as two workers behind NAT whose relay is gone, say): the first
    ``times`` attempts whose group holds both fail on that dial, in the runner's own connect."""

    def __init__(self, other: str, times: int = 10**9):
        self.other, self.groups, self.times = other, [], times
        hooks = self

        class Undialable(RoundRunner):
            async def run(self, connect):
                async def no_link(peer):
                    if peer == hooks.other and hooks.times > 0:
                        hooks.times -= 1
                        raise Unreachable(f"could not dial {peer[-8:]}: failed to dial", {peer})
                    return await connect(peer)

                return await super().run(no_link)

        self.runner = Undialable

    def runner_for(self, group, default):
        self.groups.append(group.members)
        return self.runner


def test_a_member_that_cannot_dial_another_goes_on_without_it(workers):
    comms = workers(3, dataclasses.replace(SETTINGS, max_attempts=3, straggler_wait=5.0, matchmaking_timeout=15.0),
                    behind_nat=2)
    a, b, c = comms
    c.hooks = NoLinkBetween(b.peer_id)
    out = together(comms, RoundKey(0))
    # The next attempt leaves one of the two out: the group goes on with the other and the third worker.
    done = [r for r in out if not isinstance(r, Exception)]
    assert len(done) == 2 and all(len(r.peers) == 2 for r in done), out
    assert not (b.peer_id in done[0].peers and c.peer_id in done[0].peers), done[0].peers
    assert done[0].peers == done[1].peers and torch.equal(done[0].flat, done[1].flat)
    # The one left out fails its round (told it is left out, or that nobody came; it catches up from the
    # group that moved on).
    left_out = next(i for i, r in enumerate(out) if isinstance(r, Exception))
    assert comms[left_out] in (b, c) and isinstance(out[left_out], AveragingError), out
    if any(b.peer_id in g and c.peer_id in g for g in c.hooks.groups):  # it tried, and failed to dial b
        assert b.peer_id in c.unreachable  # for a few outer steps


def test_a_public_member_that_cannot_be_dialled_twice_is_left_apart(workers):
    """A public member that cannot be dialled once may be restarting, and is welcome back at once; one
    that announced itself again and still cannot be dialled is alive and out of this worker's reach (a
    firewall one way, an address it has not learnt). Before, it was never named: every attempt holding
    both failed on that dial, round after round."""
    comms = workers(3, dataclasses.replace(SETTINGS, max_attempts=3, straggler_wait=5.0, matchmaking_timeout=15.0))
    a, b, c = comms
    for step in range(4):  # first a round of all three (the first round may form before all are there)
        first = together(comms, RoundKey(step))
        if all(not isinstance(r, Exception) and len(r.peers) == 3 for r in first):
            break
    else:
        pytest.fail(f"the three workers never averaged together: {first}")
    c.hooks = NoLinkBetween(b.peer_id)
    for key in (RoundKey(step + 1), RoundKey(step + 2)):
        out = together(comms, key)
        done = [r for r in out if not isinstance(r, Exception)]
        assert len(done) == 2 and done[0].peers == done[1].peers and len(done[0].peers) == 2, (key, out)
        assert not (b.peer_id in done[0].peers and c.peer_id in done[0].peers), done[0].peers
        assert torch.equal(done[0].flat, done[1].flat)
    # Named after its second failed dial, not its first, and left apart from then on: at most two
    # attempts ever held both (a retry may also form without it: a member that broke an attempt is
    # not waited for).
    both = [g for g in c.hooks.groups if b.peer_id in g and c.peer_id in g]
    assert 1 <= len(both) <= 2, c.hooks.groups
    assert (b.peer_id in c.unreachable) == (len(both) == 2), c.hooks.groups


def test_two_workers_whose_link_broke_once_average_again_when_it_is_back(workers):
    """Apart, each of two workers would be alone, and neither averages alone (the outer step, which lapses
    the names, would never move): a name that leaves nobody a group is not followed, so the retry dials
    again."""
    b, c = workers(2, dataclasses.replace(SETTINGS, min_group_size=1, max_attempts=2, straggler_wait=5.0,
                                          matchmaking_timeout=15.0))
    c.hooks = NoLinkBetween(b.peer_id, times=1)
    for _ in range(4):
        out = together([b, c], RoundKey(0))
        if not any(isinstance(r, Exception) for r in out):
            break
    assert not any(isinstance(r, Exception) for r in out), out
    assert out[0].peers == out[1].peers and len(out[0].peers) == 2
    assert b.peer_id not in c.unreachable  # a public peer that cannot be dialled is dead or restarting: not named


def test_three_workers_that_need_each_other_average_again_after_a_failed_dial(workers):
    """A run that needs all three: a name that would leave two in a part (below ``min_group_size``) is
    not followed either. Before, the name bound until its outer step lapsed, and the outer step could
    never move (the world test ``natmix`` stalled so: a NAT'd worker's first dial of the other failed
    before that one's relay was in its record)."""
    comms = workers(3, dataclasses.replace(SETTINGS, min_group_size=3, max_attempts=2, straggler_wait=5.0,
                                           matchmaking_timeout=15.0), behind_nat=2)
    a, b, c = comms
    c.hooks = NoLinkBetween(b.peer_id, times=1)
    for _ in range(4):
        out = together(comms, RoundKey(0))
        if not any(isinstance(r, Exception) for r in out):
            break
    assert not any(isinstance(r, Exception) for r in out), out
    assert out[0].peers == out[1].peers == out[2].peers and len(out[0].peers) == 3
    assert all(torch.equal(out[0].flat, r.flat) for r in out[1:])
    assert any(b.peer_id in g and c.peer_id in g for g in c.hooks.groups[1:]), c.hooks.groups  # tried again


def test_relayed_connections_that_carried_a_round_are_replaced_when_the_next_one_starts(workers):
    """A relayed connection between two workers behind NAT is replaced after it carried a round (a
    relay's quota is per connection), but only when the next round starts, before its announcement.
    Replaced a second after a round, it met the next round's first attempt whenever rounds came that
    fast: in ``natmix`` the first attempt of every round failed (20 of 20), and none once moved."""
    comms = workers(3, dataclasses.replace(SETTINGS, min_group_size=3, max_attempts=3, straggler_wait=5.0,
                                           matchmaking_timeout=15.0), behind_nat=2)
    natted = [c for c in comms[1:] if c.relay_links is not None]
    assert len(natted) == 2, "both client-mode workers dial through relays"
    for step in range(4):  # a first round of all three (the first may form before all are there)
        out = together(comms, RoundKey(step))
        if all(not isinstance(r, Exception) and len(r.peers) == 3 for r in out):
            break
    else:
        pytest.fail(f"the three workers never averaged together: {out}")
    held = sum(len(c.relay_links._held) for c in natted)
    assert held, "the two behind NAT held no relayed connection to each other"
    renewed = sum(c.relay_links.renewed for c in natted)
    time.sleep(3.0)  # between rounds: nothing is replaced (before, it was a second after the round)
    assert sum(c.relay_links.renewed for c in natted) == renewed
    out = together(comms, RoundKey(step + 1))
    assert all(not isinstance(r, Exception) and len(r.peers) == 3 for r in out), out
    assert sum(c.relay_links.renewed for c in natted) > renewed  # replaced when that round started


def test_a_peer_whose_dial_fails_is_named_unreachable():
    """What the daemon says when it cannot reach a peer at all becomes ``Unreachable`` (a peer that
    answers and then fails is another error)."""
    node = start_dht(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    other = start_dht(initial_peers=[str(m) for m in node.get_visible_maddrs()], host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    gone = other.peer_id.to_base58()
    other.shutdown()  # its address stays in the node's book: the dial is tried, and fails

    async def dial():
        p2p = await node.replicate_p2p()
        deadline = time.monotonic() + 30  # until the node has seen the connection close
        while any(str(info.peer_id) == gone for info in await p2p.list_peers()):
            assert time.monotonic() < deadline, "the node still holds a connection to the stopped peer"
            await asyncio.sleep(0.2)
        streams = P2PStreams(p2p, "opendiloco.retries.reduce")
        with pytest.raises(Unreachable, match="could not dial") as caught:
            await asyncio.wait_for(streams.connect(gone), 60)
        assert caught.value.peers == {gone}

    try:
        asyncio.run(dial())
    finally:
        node.shutdown()


class HeldThenBroken(RoundHooks):
    """The first attempt's exchange waits until ``release`` is set, then fails (a member that stalled
    in the round, then died)."""

    def __init__(self):
        self.entered, self.release = threading.Event(), threading.Event()
        self.attempts = 0
        hooks = self

        class Held(RoundRunner):
            async def run(self, connect):
                hooks.entered.set()
                while not hooks.release.is_set():
                    await asyncio.sleep(0.05)
                raise AveragingError("the exchange stalled, then broke")

        self.held = Held

    def runner_for(self, group, default):
        self.attempts += 1
        return self.held if self.attempts == 1 else default


def test_a_worker_left_out_of_a_group_that_fails_goes_back_to_the_round(workers):
    """A worker that comes late to a round whose group went ahead without it is left out, and waits to
    download the group's result. When that group fails, there is no result to wait for: its members try
    the round again, and wait for this worker there. The catch-up used to wait for its whole timeout
    (60 s in the optimizer) while the others, needing it for a quorum of 2, gave up on their round
    (found in a loaded suite run, tests/swarm/test_heterogeneous.py)."""
    settings = dataclasses.replace(SETTINGS, max_attempts=3, straggler_wait=2.0)
    w0, w1, late = workers(3, settings)
    hooks = [HeldThenBroken(), HeldThenBroken()]
    w0.hooks, w1.hooks = hooks
    key = RoundKey(0)
    rounds = [comm.start(torch.full((64,), float(i + 1)), weight=1.0, key=key) for i, comm in enumerate((w0, w1))]
    for h in hooks:  # the two went ahead without the late worker, and are in their exchange
        assert h.entered.wait(60), "the group of two never formed"
    # The late worker has read their group (a loaded machine's DHT can take longer than the grace a closing
    # worker gives a read under way, and a worker that has not seen the group closes one of its own).
    pair, deadline = sorted([w0.peer_id, w1.peer_id]), time.monotonic() + 60
    group_key, ttl = late.records.group_key(key, 0), settings.matchmaking_settings().record_ttl + 10
    while pair not in [sorted(g) for g in late.records.subkey_values(group_key, ttl).values()]:
        assert time.monotonic() < deadline, "the late worker never read the group of two"
        time.sleep(0.2)
    with pytest.raises(BehindError, match="left out of the group"):
        late.start(torch.full((64,), 3.0), weight=1.0, key=key).wait(60)

    outcome: list = []

    def catch_up():  # what the optimizer does on that error: wait for a state of the next outer step
        try:
            outcome.append(late.download_state(600.0, min_outer_step=key.outer_step + 1))
        except AveragingError as e:
            outcome.append(e)

    waiting = threading.Thread(target=catch_up)
    waiting.start()
    for h in hooks:
        h.release.set()  # the group's attempt fails: its members try the round again
    waiting.join(120)  # far inside the catch-up's own 600 s
    assert not waiting.is_alive(), "the catch-up still waits for the result of a group that failed"
    assert len(outcome) == 1 and isinstance(outcome[0], AveragingError), outcome
    assert "did not complete it" in str(outcome[0]), outcome[0]
    late.interrupt()
    for r in rounds:  # the other two end their round either way (with each other, or failed)
        try:
            r.wait(90)
        except AveragingError:
            pass


def test_a_round_done_again_after_going_back_uses_attempts_it_has_not_used(workers):
    """The smaller side of a healed partition goes back to the run's state and does again rounds it had
    completed on its own, at the same keys. Its attempts started at 0 again: the group id of the
    attempt it had completed, which its members refuse ("already finished"), and whose group is still
    in the records (in the long scenario, three workers failed that attempt, waited out their peers as
    no-shows and averaged alone again: a second fork)."""
    pair = workers(2)
    for key in (RoundKey(5), RoundKey(6), RoundKey(5)):  # back to outer step 5, as after a download of its state
        out = together(pair, key)
        assert all(not isinstance(r, Exception) for r in out), (key, out)
        assert all(sorted(r.peers) == sorted(c.peer_id for c in pair) for r in out), out


def round_of_three(trio, entered: threading.Event) -> tuple[list, list]:
    """Starts round 0 on the three workers at once; each one's result or error, and the seconds it took
    (``entered``: set when the group formed)."""
    out: list = [None] * 3
    took: list = [None] * 3

    def run(i):
        t0 = time.monotonic()
        try:
            out[i] = trio[i].start(torch.full((64,), float(i + 1)), weight=1.0, key=RoundKey(0)).wait(120)
        except AveragingError as e:
            out[i] = e
        took[i] = time.monotonic() - t0

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    assert entered.wait(60), "the group of three never formed"
    for t in threads:
        t.join(120)
    return out, took


class SilentUntilReleased(RoundHooks):
    """Hooks whose round answers none of the others' streams until ``release`` (they stay open and
    silent); what its own attempt does is ``attempt``, a subclass's."""

    def __init__(self):
        self.entered, self.release = threading.Event(), threading.Event()
        hooks = self

        class Silent(RoundRunner):
            async def run(self, connect):
                hooks.entered.set()
                try:
                    await hooks.attempt(self)
                finally:
                    self.ended.set()

            async def serve(self, stream, opening):
                while not hooks.release.is_set():
                    await asyncio.sleep(0.05)
                stream.close()

        self.runner = Silent

    async def attempt(self, runner: RoundRunner) -> None:
        raise NotImplementedError

    def runner_for(self, group, default):
        return self.runner


class CutOffInExchange(SilentUntilReleased):
    """Every attempt's exchange on this worker sends nothing and reads nothing until ``release``, as a
    worker whose address changed mid-round: its streams, and the others' to it, hang on connections
    that are gone, while its DHT node (here: the same one) keeps its record fresh."""

    async def attempt(self, runner):
        while not self.release.is_set() and not runner._failed.is_set():
            await asyncio.sleep(0.05)
        runner._raise_if_failed()
        raise AveragingError("released")


def test_a_member_cut_off_mid_round_abandons_it_and_the_others_stop_waiting(workers):
    """A member whose connections died silently (its address changed) held every worker of its round
    39-58 s in the world scenario: its record stays fresh, so the round waited out its exchange's
    timeout. Now the member, hearing nothing from any other member for ``cut_off_after`` seconds while
    it waits on them, abandons the attempt and says so in its record (``WorkerRecord.abandoned``), and the
    others give up on it then: far inside the exchange's timeout. The two others, who heard from each
    other, do not take themselves for cut off."""
    settings = dataclasses.replace(SETTINGS, allreduce_timeout=90.0, min_group_size=3, cut_off_after=3.0)
    trio = workers(3, settings)
    cut = CutOffInExchange()
    trio[2].hooks = cut

    async def connections_gone_already(peers):  # its closing them reaches nobody in the world
        cut.closed = set(peers)

    trio[2].connectivity.disconnect = connections_gone_already
    # Its relay slots (as if behind NAT, with trio[0] its relay), asked for once here and then only when
    # something says they may be gone: a cut-off is such a thing (its router's address may have changed).
    relay = [str(trio[0].dht.get_visible_maddrs()[0])]
    slots = trio[2].connectivity.relay_slots = RelaySlots(trio[2].p2p, relay, every=3600)
    trio[2]._loop.call_soon_threadsafe(trio[2]._in_background, slots.keep())
    try:
        deadline = time.monotonic() + 60
        while slots.asked < 1:
            assert time.monotonic() < deadline, "it never asked its relay"
            time.sleep(0.1)
        assert slots.held == {trio[0].peer_id: True}
        out, took = round_of_three(trio, cut.entered)
        assert isinstance(out[2], AveragingError) and "heard nothing from any member" in str(out[2]), out
        assert trio[2].presence.abandoned, "its record does not say it was cut off"
        while slots.asked < 2:
            assert time.monotonic() < deadline, "cut off, it did not ask its relays for its slots again"
            time.sleep(0.1)
        assert cut.closed == {c.peer_id for c in trio[:2]}, "it did not drop its connections to dial anew"
        # One of the two read its record first; the other's attempt ended with that one's (a refusal).
        assert any("ended its attempt" in str(r) for r in out[:2]), out
        for i in range(2):
            assert isinstance(out[i], AveragingError), out
            assert took[i] < settings.allreduce_timeout / 2, took  # not the exchange's timeout
        assert not any("heard nothing" in str(r) for r in out[:2]), out  # neither took itself for cut off
    finally:
        cut.release.set()


class NewAddressInExchange(CutOffInExchange):
    """As ``CutOffInExchange``, and once the exchange is under way the daemon says it listens elsewhere:
    the address it listened on is gone (its lookup, ``Presence.find_addrs``, answers the new one)."""

    def __init__(self, comm: SwarmCommunicator):
        super().__init__()
        self.comm = comm

    async def attempt(self, runner):
        async def elsewhere():
            return ["/ip4/127.0.0.9/tcp/4321"]

        self.comm.presence.find_addrs = elsewhere
        await super().attempt(runner)


def test_a_member_whose_address_changed_mid_round_abandons_it_at_once(workers):
    """Its connections through the old address are dead, and every stream of the attempt hangs on them;
    it heard nothing from anyone, and waited ``cut_off_after`` to conclude so (the others with it). Its
    daemon's addresses, looked up at each heartbeat, say so at once: an address it listened on is gone.
    It closes its connections and abandons the attempt then, and the others stop waiting on it."""
    settings = dataclasses.replace(SETTINGS, allreduce_timeout=120.0, min_group_size=3, cut_off_after=60.0)
    trio = workers(3, settings)
    moved = NewAddressInExchange(trio[2])
    trio[2].hooks = moved
    closed: set[str] = set()

    async def connections_gone_already(peers):  # its closing them reaches nobody in the world
        closed.update(peers)

    trio[2].connectivity.disconnect = connections_gone_already
    try:
        out, took = round_of_three(trio, moved.entered)
        assert isinstance(out[2], AveragingError) and "address changed" in str(out[2]), out
        assert trio[2].presence.abandoned, "its record does not say it abandoned the attempt"
        assert {c.peer_id for c in trio[:2]} <= closed, "it did not drop its connections to dial anew"
        for i in range(2):
            assert isinstance(out[i], AveragingError), out
            assert took[i] < settings.cut_off_after, took  # not the cut-off's silence, nor the exchange's timeout
        assert not any("heard nothing" in str(r) for r in out), out
    finally:
        moved.release.set()


def test_a_settle_does_not_wait_on_a_member_whose_record_says_it_failed_the_attempt(workers):
    """A member cut off by a new address behind NAT keeps its record fresh, and says there that it failed
    the attempt; the others' question to it (did it complete the round?) hung on its dead connection for
    15 s in the long scenario. It cannot have completed an attempt it failed: not waited for."""
    a, b = workers(2)
    group = Group("g-settle", (a.peer_id, b.peer_id), RoundKey(7), attempt=0)
    assert a._out_of(group, "12D3KooWnobodyInTheRecords")
    deadline = time.monotonic() + 60

    def seen(abandoned: str):
        while (record := a.snapshot.workers.get(b.peer_id)) is None or record.abandoned != abandoned:
            assert time.monotonic() < deadline, record
            time.sleep(0.1)

    seen("")
    assert not a._out_of(group, b.peer_id)
    b._call(b.presence.say_abandoned("another-group"), timeout=30)
    seen("another-group")
    assert not a._out_of(group, b.peer_id)  # it failed some other attempt
    b._call(b.presence.say_abandoned(group.group_id), timeout=30)
    seen(group.group_id)
    assert a._out_of(group, b.peer_id)


class FailsWithStreamsStuck(SilentUntilReleased):
    """This worker's attempt fails at once, and its refusals never reach the others: their streams to it
    stay open and silent (stuck in a relay, say) until ``release``."""

    async def attempt(self, runner):
        await asyncio.sleep(0.5)
        raise AveragingError("its own failure")


def test_a_member_that_failed_its_attempt_is_not_waited_for_where_its_refusal_is_stuck(workers):
    """In the long world scenario a worker behind NAT waited 60 s on the other one, whose attempt had
    failed at once: its refusal never came through the relay, and every member's settle waited on the
    first one's answer. A member that fails an attempt now says so in its record
    (``WorkerRecord.abandoned``), and a member still waiting on it there gives up on it then."""
    settings = dataclasses.replace(SETTINGS, allreduce_timeout=90.0, min_group_size=3, cut_off_after=0.0)
    trio = workers(3, settings)
    fails = FailsWithStreamsStuck()
    trio[2].hooks = fails
    try:
        out, took = round_of_three(trio, fails.entered)
        assert isinstance(out[2], AveragingError) and "its own failure" in str(out[2]), out
        assert any("ended its attempt" in str(r) for r in out[:2]), out
        for i in range(2):
            assert isinstance(out[i], AveragingError), out
            assert took[i] < settings.allreduce_timeout / 2, took
    finally:
        fails.release.set()
