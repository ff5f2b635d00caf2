"""The rule that takes a round's member for frozen (``swarm/frozen.py``), on the round's view of it.

The swarm itself is tested in test_resilience.py (a member and its daemon frozen by SIGSTOP); here,
the cases that a loopback swarm cannot make: this worker cut off from everyone (every ping
unanswered), and a member that sends a frame while its ping is out.
"""

import asyncio
import time

import pytest

from opendiloco.swarm import frozen
from opendiloco.swarm.frozen import FrozenProbe

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
