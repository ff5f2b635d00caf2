"""Members that broke rounds, or that this worker cannot reach, left out of the next groups.

A worker whose own checks found a member's bytes malformed (``errors.Malformed``: a part of the wrong
size or order, non-finite values, an average that does not match its digest) remembers that member for
``rounds`` outer steps (``Offenders``) and names it in its announcements (``avoid``). Only this
worker's own checks put a peer there, never another peer's word.

An announced ``avoid`` binds its announcer: a group never holds both a member and a peer it avoids.
Who of the two is left out is decided the same way by every member, from the announcements alone
(``conflict_free``): the peer in the most conflicts goes, then the one named by more members, then the
larger id. So a member caught by one honest worker is out of the very next attempt, while a peer that
names others without cause can keep out at most one honest member (naming a second makes it the one in
the most conflicts), and only from groups it is in itself. See docs/trust.md.

A member behind NAT that this worker could not dial at all (``errors.Unreachable``: its relay is
gone), or a public member it could not dial twice in a row, is named the same way, under
``unreachable``, for ``UNREACHABLE_ROUNDS`` outer steps: every attempt with both of them would fail,
so the group goes on without one of the two, and they try each other again once the names lapse.
The matchmaker follows these names only where they leave some part of two or more (two workers
apart would each be alone, and the names would never lapse).

A member that broke an attempt of this worker's without sending anything malformed (it refused, or asked
how the round ended while this worker still needed its bytes, blaming no third member: ``comm/blame.py``)
is named under ``broke`` (``Breakers``): for the rest of that round the first time, twice as many outer
steps at each repeat within ``EXCLUDE_ROUNDS`` (at most that many). Its names are followed as those of
unreachable peers are, only where they leave a group big enough. So one such member costs a round at most
one attempt, and ever fewer rounds as it goes on; an honest member named by mistake (it failed for a
reason it did not give) sits out one round's retries.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Iterable, Mapping

from ..errors import InDoubt, PeerFailure

log = logging.getLogger(__name__)

MAX_AVOID = 4
"""The most peers one announcement names (this worker's latest offenders; a reader takes no more)."""
MAX_OFFENDERS = 64
"""The most peers ``Offenders`` remembers: the oldest entry goes first."""
EXCLUDE_ROUNDS = 16
"""How many outer steps an offender is left out of this worker's groups, from the one it was caught in."""
UNREACHABLE_ROUNDS = 3
"""How many outer steps a member this worker could not dial stays apart from it."""


class Offenders:
    """The peers this worker caught sending malformed data, each until an outer step (bounded in size)."""

    what = "sent malformed data"

    def __init__(self, rounds: int = EXCLUDE_ROUNDS, capacity: int = MAX_OFFENDERS):
        self.rounds, self.capacity = rounds, capacity
        self._until: collections.OrderedDict[str, int] = collections.OrderedDict()

    def add(self, peer: str, outer_step: int, reason: str) -> None:
        """``peer`` failed this worker's checks in the round of ``outer_step``; a repeat renews its time."""
        renewed = peer in self._until
        self._until.pop(peer, None)
        self._until[peer] = outer_step + self.rounds
        while len(self._until) > self.capacity:
            self._until.popitem(last=False)
        log.warning("peer %s %s in round %d (%s); %s out of this worker's groups until outer step %d", peer[-8:],
                    self.what, outer_step, reason, "still" if renewed else "left", outer_step + self.rounds)

    def named(self) -> list[str]:
        """The peers named now, whatever the outer step they are named until."""
        return list(self._until)

    def forget(self, peers: Iterable[str]) -> None:
        """Drops ``peers`` (the next attempt tries them again)."""
        for peer in peers:
            self._until.pop(peer, None)

    def active(self, outer_step: int) -> list[str]:
        """The offenders still left out at ``outer_step``, the latest caught first, at most ``MAX_AVOID``."""
        for peer in [p for p, until in self._until.items() if until < outer_step]:
            del self._until[peer]
        return list(reversed(self._until))[:MAX_AVOID]

    def __contains__(self, peer: str) -> bool:
        return peer in self._until


class UnreachablePeers(Offenders):
    """The members this worker could not dial, each until an outer step (bounded in size).

    A member behind NAT is named at its first failed dial (its relay is gone). A public member is named
    at its second failed dial with no completed round between (``failed_dial``): the first may be a
    restart, and a restarted worker is welcome back at once; a member that announced itself again for
    the next attempt is alive, and still cannot be dialled from here (a firewall one way, an address
    this worker has not learnt): every attempt holding both would fail the same way."""

    what = "could not be dialled"

    def __init__(self, rounds: int = UNREACHABLE_ROUNDS, capacity: int = MAX_OFFENDERS):
        super().__init__(rounds, capacity)
        self._strikes: collections.OrderedDict[str, int] = collections.OrderedDict()
        """Public members whose last dial failed, with the outer step it failed in."""

    def failed_dial(self, peer: str, outer_step: int, *, relayed: bool) -> None:
        """This worker's dial to ``peer`` failed in an attempt at ``outer_step``."""
        struck = self._strikes.pop(peer, None)
        if relayed or (struck is not None and outer_step - struck <= self.rounds):
            self.add(peer, outer_step, "the p2p daemon could not connect" + ("" if relayed else ", twice"))
            return
        self._strikes[peer] = outer_step
        while len(self._strikes) > self.capacity:
            self._strikes.popitem(last=False)

    def reached(self, peers: Iterable[str]) -> None:
        """A round with ``peers`` completed: their failed dials are forgotten."""
        for peer in peers:
            self._strikes.pop(peer, None)


class Breakers(Offenders):
    """The members that broke an attempt of this worker's (``RoundRunner.breakers``): out of its groups
    for the rest of that outer step the first time, then 1, 3, 7... more while they keep at it (a strike
    older than ``EXCLUDE_ROUNDS`` outer steps is forgotten)."""

    what = "broke an attempt"

    def __init__(self, capacity: int = MAX_OFFENDERS):
        super().__init__(0, capacity)
        self._strikes: collections.OrderedDict[str, tuple[int, int]] = collections.OrderedDict()
        """peer -> (strikes, the outer step of the latest)."""

    def add(self, peer: str, outer_step: int, reason: str) -> None:
        count, last = self._strikes.pop(peer, (0, outer_step))
        count = count + 1 if outer_step - last <= EXCLUDE_ROUNDS else 1
        self._strikes[peer] = (count, outer_step)
        while len(self._strikes) > self.capacity:
            self._strikes.popitem(last=False)
        self.rounds = exclusion_rounds(count)
        super().add(peer, outer_step, reason)


def exclusion_rounds(strikes: int) -> int:
    """Outer steps after the current one that a member that broke ``strikes`` attempts is left out for."""
    return min(EXCLUDE_ROUNDS, 2 ** (max(strikes, 1) - 1) - 1)


def announced_avoid(value, field: str = "avoid") -> frozenset[str]:
    """The peers an announcement's ``avoid`` (or another such field) names (anything out of form: none;
    at most ``MAX_AVOID``)."""
    avoid = value.get(field) if isinstance(value, dict) else None
    if not isinstance(avoid, list):
        return frozenset()
    return frozenset([p for p in avoid if isinstance(p, str) and len(p) <= 128][:MAX_AVOID])


def conflicts(members: Iterable[str], avoids: Mapping[str, frozenset[str]]) -> set[tuple[str, str]]:
    """(a, b) for each member a that avoids a member b."""
    members = set(members)
    return {(a, b) for a in members for b in avoids.get(a, ()) if b in members and b != a}


def conflict_free(candidates: Iterable[str], avoids: Mapping[str, frozenset[str]]) -> set[str]:
    """The candidates less those left out so that no member avoids another (the same on every member).

    One at a time: the peer in conflict with the most others, then the one named by the most, then the
    larger id. Pure: a function of the candidates and their announcements."""
    group = set(candidates)
    while edges := conflicts(group, avoids):
        against: dict[str, set[str]] = collections.defaultdict(set)
        named: collections.Counter = collections.Counter()
        for a, b in edges:
            against[a].add(b)
            against[b].add(a)
            named[b] += 1
        group.discard(max(against, key=lambda p: (len(against[p]), named[p], p)))
    return group


def partition(candidates: Iterable[str], avoids: Mapping[str, frozenset[str]]) -> list[set[str]]:
    """The candidates cut into groups without conflicts: ``conflict_free`` of them, then of the rest..."""
    rest, parts = set(candidates), []
    while rest:
        part = conflict_free(rest, avoids)
        parts.append(part)
        rest -= part
    return parts


def part_of(me: str, candidates: Iterable[str], avoids: Mapping[str, frozenset[str]]) -> set[str]:
    """The group ``partition`` gives ``me`` (``me`` is among the candidates)."""
    return next(part for part in partition(set(candidates) | {me}, avoids) if me in part)


def retry_suspects(error: Exception, me: str, refused_by: Iterable[str] = ()) -> set[str]:
    """The members a failed attempt names, left out of what the round's retry waits for (they may still join
    it): the culprits of a ``PeerFailure``, less this worker and those that refused it (``refused_by``) or said
    they failed too (alive: their own attempt failed, they come back for the retry); plus those an attempt in
    doubt found gone from the run."""
    if not isinstance(error, PeerFailure):
        return set()
    in_doubt = isinstance(error, InDoubt)
    named = set(error.peers) - {me} - set(refused_by) - (set(error.failed_too) if in_doubt else set())
    return named | ((set(error.gone) if in_doubt else set()) - {me})
