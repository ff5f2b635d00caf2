"""A peer that froze (SIGSTOP, a paused VM, a machine asleep): in a round's exchange, or on its way to one.

It sends nothing and closes nothing, and its record lives on until ``record_ttl`` after its last
heartbeat, so the others used to wait that long and more before they gave up on it: 10-13 s per
freeze in the long world scenario, every other member idle. Its p2p daemon froze with it, so
libp2p's ping to it goes unanswered; a member that is slow but alive (its training loop busy, its
link full) echoes at once, because its daemon is another process. An unanswered ping proves
nothing where this worker is the one cut off, so a member is taken for frozen only while another
member proved this worker's links alive in the same window: a frame of the round, or an echo.

Members reached through a relay are not pinged in a round (their pings travel the relay's limited
connection); their records still tell when they are gone. Matchmaking pings one whose record has missed
a heartbeat (``RELAYED_QUIET_S``), and takes only a failed ping for an answer (``Unanswered``): a killed
one's relays hold no slot for it and refuse the dial at once, while an echo that is late through a relay
proves nothing, and a dial to a live one may fail for a while (a relay's hiccup, a dial backoff).

Matchmaking asks the same of the peers it would wait for (``Unanswered``): a peer that froze before
its round, or whose round's attempt another member gave up on it in, keeps a record that says it is
coming, and used to be waited for until that record expired or its grace ran out.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable, Iterable

from ...timeouts import FROZEN_FOUND_FOR_S as FOUND_FOR_S
from ...timeouts import FROZEN_PING_EVERY_S as PING_EVERY_S
from ...timeouts import FROZEN_SILENT_S as SILENT_S

Ping = Callable[[str], Awaitable["bool | None"]]
"""libp2p's ping to a peer: True if it echoed, False if the stream failed, None if no echo came in time."""


class FrozenProbe:
    """The pings of one attempt of a round, read by the watch over it once a second (``step``)."""

    def __init__(self, runner, ping: Ping, me: str, skip: Iterable[str] = ()):
        self._runner, self._ping, self._me = runner, ping, me
        self._skip = set(skip) | {me}
        self._pings: dict[str, tuple[float, asyncio.Task]] = {}
        self._echoed_at: dict[str, float] = {}

    def step(self) -> str | None:
        """Reads the pings that ended and starts new ones; the member taken for frozen, if any."""
        now = time.monotonic()
        unanswered = []
        for member, (sent, task) in list(self._pings.items()):
            if not task.done():
                continue
            del self._pings[member]
            if task.result() is True:
                self._echoed_at[member] = now
            elif task.result() is None:
                unanswered.append((member, sent))
        for member, sent in unanswered:
            if not self._heard_since(member, sent) and self._others_alive_since(member, sent):
                return member
        owing = [m for m in self._runner.members
                 if m not in self._skip and self._runner.waits_on(m) and self._silent(m, now) >= SILENT_S]
        for member in owing:
            self._send(member, now)
        if owing and not any(self._others_alive_since(m, now - SILENT_S) for m in owing):
            control = self._control(exclude=set(owing))
            if control is not None:  # a member that can prove this worker's links alive while the others are pinged
                self._send(control, now)
        return None

    def close(self) -> None:
        for _, task in self._pings.values():
            task.cancel()
        self._pings.clear()

    def _send(self, member: str, now: float) -> None:
        if member not in self._pings:
            self._pings[member] = (now, asyncio.ensure_future(self._ping(member)))

    def _silent(self, member: str, now: float) -> float:
        return now - self._runner.heard_from.get(member, self._runner.began_at)

    def _heard_since(self, member: str, since: float) -> bool:
        return self._runner.heard_from.get(member, float("-inf")) >= since

    def _others_alive_since(self, member: str, since: float) -> bool:
        return any(m != member and (self._heard_since(m, since) or self._echoed_at.get(m, float("-inf")) >= since)
                   for m in self._runner.members if m != self._me)

    def _control(self, exclude: set[str]) -> str | None:
        """The member heard from last (first in the group where none was), outside ``exclude``."""
        candidates = [m for m in self._runner.members if m not in self._skip and m not in exclude]
        if not candidates:
            return None
        return max(candidates, key=lambda m: self._runner.heard_from.get(m, float("-inf")))


class Unanswered:
    """The peers found frozen, for matchmaking: each left a ping unanswered for ``PING_TIMEOUT_S`` (or
    failed it: a killed worker, whose record lives on, refuses the dial) while a peer pinged with it
    echoed. Pings run on the communicator's loop; ``probe`` and ``frozen`` are called
    from the round's thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop, ping: Ping):
        self._loop, self._ping = loop, ping
        self._lock = threading.Lock()
        self._found: dict[str, float] = {}
        self._pinged: dict[str, float] = {}

    def found(self, peer: str) -> None:
        with self._lock:
            self._found[peer] = time.monotonic()

    def back(self, peers: Iterable[str]) -> None:
        """These peers proved alive otherwise (a peer behind NAT wrote a fresh record): not frozen."""
        with self._lock:
            for peer in peers:
                self._found.pop(peer, None)

    def frozen(self) -> frozenset[str]:
        now = time.monotonic()
        with self._lock:
            return frozenset(p for p, t in self._found.items() if now - t < FOUND_FOR_S)

    def probe(self, peers: Iterable[str], controls: Iterable[str], relayed: Iterable[str] = ()) -> None:
        """Pings those of ``peers`` not pinged within ``PING_EVERY_S``, with the first of ``controls`` that is
        not among them (nothing without one: an unanswered ping proves nothing alone). Returns at once.
        Of the ``relayed`` (reached through relays), only a failed ping counts: a killed one's relays refuse
        the dial; a late echo may be the relay's."""
        now = time.monotonic()
        relayed = frozenset(relayed)
        with self._lock:
            for kept in (self._pinged, self._found):  # peers come and go
                for p in [p for p, t in kept.items() if now - t >= FOUND_FOR_S]:
                    del kept[p]
            due = sorted(p for p in peers if now - self._pinged.get(p, float("-inf")) >= PING_EVERY_S)
            control = next((c for c in controls if c not in due), None)
            if not due or control is None:
                return
            for p in due:
                self._pinged[p] = now
        try:
            asyncio.run_coroutine_threadsafe(self._check(due, control, relayed), self._loop)
        except RuntimeError:  # the loop is closed: the communicator is shutting down
            return

    async def _check(self, peers: list[str], control: str, relayed: frozenset[str] = frozenset()) -> None:
        answers = await asyncio.gather(self._ping(control), *(self._ping(p) for p in peers))
        for peer, answer in zip(peers, answers[1:]):
            if answer is True:  # back (thawed), or never frozen
                with self._lock:
                    self._found.pop(peer, None)
            elif answers[0] is True and (answer is False or peer not in relayed):
                self.found(peer)  # no echo (a killed worker's address refuses the dial: no better)
