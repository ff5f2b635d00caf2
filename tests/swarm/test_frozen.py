"""The rule that takes a round's member for frozen (``swarm/connectivity/frozen.py``), on the round's view of it.

The swarm itself is tested in test_resilience.py (a worker and its daemon frozen by SIGSTOP, in a
round and on its way to one); here, the cases that a loopback swarm cannot make: this worker cut off
from everyone (every ping unanswered), a member that sends a frame while its ping is out, and a
frozen peer that echoes again.
"""

import asyncio
import threading
import time

import pytest

from opendiloco.swarm.connectivity import frozen
from opendiloco.swarm.connectivity.frozen import FrozenProbe

pytestmark = [pytest.mark.fast, pytest.mark.timeout(30)]

ME, A, B, RELAYED = "me", "peer-a", "peer-b", "peer-relayed"


class RoundView:
    """What the probe reads of a round: its members, whom it waits on, and when each last sent a frame."""

    def __init__(self, members, owing):
        self.members, self.owing = members, set(owing)
        self.began_at = time.monotonic()
        self.heard_from: dict[str, float] = {}

    def waits_on(self, member):
        return member in self.owing


def pings(answers: dict[str, bool | None], sent: list[str], delay: float = 0.05):
    async def ping(peer):
        sent.append(peer)
        await asyncio.sleep(delay)
        return answers[peer]
    return ping


async def steps(probe, n, every=0.06):
    """The members ``probe`` finds in ``n`` looks (the watch's looks, quicker), up to the first it finds."""
    try:
        for _ in range(n):
            found = probe.step()
            if found is not None:
                return [found]
            await asyncio.sleep(every)
        return []
    finally:
        probe.close()


@pytest.fixture(autouse=True)
def quick(monkeypatch):
    monkeypatch.setattr(frozen, "SILENT_S", 0.05)


def test_a_member_that_leaves_its_ping_unanswered_while_another_echoes_is_frozen():
    view, sent = RoundView([ME, A, B], owing=[A]), []
    probe = FrozenProbe(view, pings({A: None, B: True}, sent), ME)
    assert asyncio.run(steps(probe, 100)) == [A]
    assert B in sent  # the control: the member that proved this worker's links alive


def test_nobody_is_frozen_when_every_ping_goes_unanswered():
    """This worker is the one cut off: its silence is its own, and the cut-off rule deals with it."""
    view, sent = RoundView([ME, A, B], owing=[A, B]), []
    probe = FrozenProbe(view, pings({A: None, B: None}, sent), ME)
    assert asyncio.run(steps(probe, 12)) == []
    assert sent.count(A) >= 2 and sent.count(B) >= 2  # pinged, unanswered, and pinged again


def test_a_member_that_sends_a_frame_while_its_ping_is_out_is_not_frozen():
    view, sent = RoundView([ME, A, B], owing=[A]), []

    async def ping(peer):
        sent.append(peer)
        await asyncio.sleep(0.05)
        if peer == A:
            view.heard_from[A] = time.monotonic()  # a part of the exchange came in meanwhile
            return None
        return True

    found = asyncio.run(steps(FrozenProbe(view, ping, ME), 3, every=0.2))
    assert found == [] and A in sent


def test_a_member_reached_through_a_relay_is_never_pinged():
    view, sent = RoundView([ME, A, RELAYED], owing=[RELAYED]), []
    probe = FrozenProbe(view, pings({A: True, RELAYED: None}, sent), ME, skip={RELAYED})
    assert asyncio.run(steps(probe, 6)) == []
    assert RELAYED not in sent


def test_a_member_the_round_no_longer_waits_on_is_not_pinged():
    view, sent = RoundView([ME, A, B], owing=[]), []
    probe = FrozenProbe(view, pings({A: None, B: None}, sent), ME)
    assert asyncio.run(steps(probe, 6)) == [] and sent == []


def _loop_thread():
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    return loop, thread


def _until(condition, bound=10.0):
    end = time.monotonic() + bound
    while not condition() and time.monotonic() < end:
        time.sleep(0.01)
    return condition()


def test_matchmaking_finds_a_peer_frozen_only_beside_one_that_echoes(monkeypatch):
    """``Unanswered``, called from the round's thread as matchmaking does: a peer found frozen (or dead) while
    a control echoed; nobody found without a control; a found peer that echoes again is back."""
    monkeypatch.setattr(frozen, "PING_EVERY_S", 0.0)
    loop, thread = _loop_thread()
    answers, sent = {A: None, B: True}, []
    try:
        liveness = frozen.Unanswered(loop, pings(answers, sent))
        liveness.probe({A}, controls=[])  # no control: no ping at all
        time.sleep(0.2)
        assert sent == [] and liveness.frozen() == frozenset()
        liveness.probe({A}, controls=[A, B])  # the control is never the peer asked about
        assert _until(lambda: liveness.frozen() == {A})
        assert set(sent) == {A, B}
        answers[A] = True  # thawed
        liveness.probe({A}, controls=[B])
        assert _until(lambda: liveness.frozen() == frozenset())
        answers[A] = False  # its dial refused (a killed worker): no echo either
        liveness.probe({A}, controls=[B])
        assert _until(lambda: liveness.frozen() == {A})
        answers[A] = True
        liveness.probe({A}, controls=[B])
        assert _until(lambda: liveness.frozen() == frozenset())
        answers[B] = None  # the control silent too: this worker may be the one cut off
        answers[A] = None
        liveness.probe({A}, controls=[B])
        time.sleep(0.3)
        assert liveness.frozen() == frozenset()
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()


def test_matchmaking_takes_only_a_failed_ping_of_a_peer_behind_nat_for_an_answer(monkeypatch):
    """A peer reached through relays: a killed one's relays hold no slot for it and refuse the dial (a
    failed ping), so it is not waited for (in the long world scenario each NAT'd worker's kill cost the
    next round 7 s, everyone waiting for its record to expire); an echo that is late through a relay
    proves nothing, so silence alone finds nobody there."""
    monkeypatch.setattr(frozen, "PING_EVERY_S", 0.0)
    loop, thread = _loop_thread()
    answers, sent = {RELAYED: None, B: True}, []
    try:
        liveness = frozen.Unanswered(loop, pings(answers, sent))
        liveness.probe({RELAYED}, controls=[B], relayed={RELAYED})
        assert _until(lambda: RELAYED in sent)
        time.sleep(0.3)
        assert liveness.frozen() == frozenset()  # late through its relay: not found
        answers[RELAYED] = False  # its relays refuse the dial: killed
        liveness.probe({RELAYED}, controls=[B], relayed={RELAYED})
        assert _until(lambda: liveness.frozen() == {RELAYED})
        answers[RELAYED] = True  # back
        liveness.probe({RELAYED}, controls=[B], relayed={RELAYED})
        assert _until(lambda: liveness.frozen() == frozenset())
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()
