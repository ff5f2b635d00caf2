"""Which groups may move θ_global while the run may be split: a majority of the workers this one last
averaged with.

A partition leaves the workers on each side able to average among themselves. Where both sides
apply rounds, θ_global forks: the smaller side's steps are applied on a state the rest of the run
never holds, and when the link heals it must go back to the larger side's state and drop them. So a
worker remembers the members of its last few completed rounds (``RecentMembers``), and a group may
apply a round only when it holds more than half of them; a group that holds exactly half goes on
if it holds the smallest id among them, so that of two equal halves exactly one does. A group with
fewer fails its round on every member (``hold``): nothing is exchanged, the members keep training,
and their local work stays in their weights, carried into the first round they are back in (a
worker that comes back behind the run catches up and keeps its work: ``DiLoCoOptimizer._catch_up``).

Every member of a group decides from the same published member list, with what it remembers
itself; the members of one side of a partition took part in the same rounds, so they decide alike.
A member that decides otherwise finds the group's other members refusing its streams at once.

A worker cannot tell a partition from a crash of the workers it misses. Holding is bounded: after
``hold_s`` seconds of holding, the workers missing are taken as gone, and its groups go on (then a
partition still going on forks, and heals as before). Workers that stop cleanly (their record says
they left) never count; workers that die one at a time never make anyone hold: each round the rest
complete updates what they remember.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Iterable

REMEMBERED_ROUNDS = 3
"""Completed rounds whose members a worker counts: more than one, since not every worker is in every
round (a straggler misses one, a NAT'd worker another); few, so that workers gone for good stop
counting after a few rounds without them."""


class RecentMembers:
    """The members of this worker's last completed rounds, and the hold on groups that lack most of them
    (thread-safe)."""

    def __init__(self, me: str, hold_s: float, rounds: int = REMEMBERED_ROUNDS,
                 clock: Callable[[], float] = time.monotonic):
        if hold_s < 0:
            raise ValueError(f"partition_hold must be >= 0 seconds, got {hold_s}")
        self.me, self.hold_s, self._clock = me, float(hold_s), clock
        self._rounds: collections.deque[frozenset[str]] = collections.deque(maxlen=max(1, rounds))
        self._holding_since: float | None = None
        self._lock = threading.Lock()

    def completed(self, members: Iterable[str]) -> None:
        """A round this worker completed, with these members."""
        with self._lock:
            self._rounds.append(frozenset(members) | {self.me})
            self._holding_since = None

    def reference(self) -> frozenset[str]:
        """The workers a group is measured against: every member of the remembered rounds (this worker too)."""
        with self._lock:
            return frozenset().union(*self._rounds) if self._rounds else frozenset()

    def holding_for(self) -> float:
        """Seconds this worker has held so far (0 when it does not hold)."""
        with self._lock:
            return 0.0 if self._holding_since is None else self._clock() - self._holding_since

    def hold(self, members: Iterable[str], departed: Iterable[str] = ()) -> str | None:
        """Why a group of ``members`` must not apply its round here (it lacks most of the workers this one
        last averaged with), or None where it may. Workers that said they left (``departed``: a clean
        stop) do not count. A hold that has lasted ``hold_s`` ends: the missing workers are forgotten,
        and this group may go on."""
        members = frozenset(members)
        with self._lock:
            if self.hold_s <= 0 or not self._rounds:
                return None
            known = frozenset().union(*self._rounds) - (frozenset(departed) - {self.me})
            inside = known & members
            if 2 * len(inside) > len(known) or (2 * len(inside) == len(known) and min(known) in members):
                return None
            now = self._clock()
            if self._holding_since is None:
                self._holding_since = now
            held = now - self._holding_since
            if held >= self.hold_s:
                self._rounds.clear()
                self._holding_since = None
                return None
            return (f"a group of {len(members)} holds {len(inside)} of the {len(known)} workers this worker last "
                    f"averaged with: the run may be split; it does not apply rounds apart from the rest "
                    f"(holding for {held:.0f}s of at most {self.hold_s:.0f}s, its work kept for the next round)")
