"""Matchmaking: who averages together for a round key, decided through the DHT and pushed records.

Each worker announces it is ready for round ``k`` (attempt ``a``). When every live worker of the
run at that outer step is ready (or the ones still missing are past the ready time they published,
plus ``straggler_wait``, with at least ``min_group_size`` ready), the ready peer with the smallest
id closes the group and publishes its members; everyone adopts the group published under the
smallest id, so no two views split the run. A group never holds both a member and a peer that member
avoids (it caught it sending malformed data, or could not dial it: ``exclusion.py``); who is left out
is decided from the announcements, the same way on every member.
That rule is ``match_rule.decide``, a pure function of what a worker has seen; ``Matchmaker`` reads the
records, announces, asks it what to do at every look, and does it (publishes, adopts, waits, pings, fails).
Announcements and groups are DHT records, and each is also pushed to the peers that need it
(``pushed_records.py``): a DHT read costs about two round trips, a push half of one, so the
matchmaker reads what was pushed and the DHT only when nothing came or now and then.
Blocking by design: it runs on the communicator's round thread, never on the event loop. A stop
request (the communicator's ``interrupted`` flag) ends every wait here at once: the polls look at it,
and so do the DHT calls they make (``records.wait_dht``), which a partition can keep waiting for seconds.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from ..comm.base import RoundKey
from ..comm.group import Group, make_group_id
from ..errors import AveragingError, BehindError, Interrupted
from ..timeouts import DHT_CALL_TIMEOUT, GROUP_READ_GRACE, RELAYED_QUIET_S
from . import match_rule, records
from .connectivity.frozen import Unanswered
from .exclusion import Breakers, Offenders, UnreachablePeers
from .match_rule import (
    Announcement,
    Close,
    Closing,
    Fail,
    Follow,
    MatchmakingSettings,
    MatchView,
    Notes,
    Peer,
    Wait,
    decide,
    next_attempt,
)
from .presence import Presence

log = logging.getLogger(__name__)


SLOW_READ_EVERY = 5
"""While a worker waits, the announcements are read every poll, but what changes slowly or rings a
doorbell when it changes (the live workers; a group its leader publishes) every this many polls: every
read of a waiting worker is a DHT lookup that its peers' DHT processes answer, and at one poll each
20 ms the reads of a few waiting workers kept their peers' DHT processes busy."""


class Doorbell:
    """Wake-ups, so that a waiting worker reads the DHT at once: from a leader that has just published
    a group (to its members), and from a worker that has just announced an attempt (to the peer with
    the smallest id, which closes groups). Between rings a waiting worker looks less and less often
    (``quiet_poll_interval``).

    A ring carries no authority: it only makes a member read the DHT now instead of at its next
    poll, so a forged ring costs two DHT reads. Thread-safe; remembers a bounded number of rings.
    """

    def __init__(self, remember: int = 256):
        self._cond = threading.Condition()
        self._rung: collections.OrderedDict = collections.OrderedDict()
        self._remember = remember

    def ring(self, key: str, attempt: int) -> None:
        with self._cond:
            self._rung[(key, attempt)] = True
            while len(self._rung) > self._remember:
                self._rung.popitem(last=False)
            self._cond.notify_all()

    def wait(self, key: str, attempt: int, timeout: float) -> bool:
        """True if rung for (key, attempt) within ``timeout``; a ring wakes one wait only."""
        with self._cond:
            rung = self._cond.wait_for(lambda: (key, attempt) in self._rung, timeout)
            self._rung.pop((key, attempt), None)
            return rung


@dataclass(frozen=True)
class LeftOut:
    """A group of this round and attempt, of these members, went ahead without this worker."""

    key: RoundKey
    attempt: int
    members: frozenset[str]


class _LiveWorkers:
    """The run's live workers as ``form_group`` reads them: a read under way is taken once it is in, or at once
    when there is no earlier view to announce on; one overdue fails the round, as a read made in place would."""

    def __init__(self, presence: Presence, me: str, workers, provisional: dict | None, check, ring: Callable):
        self.presence, self.me, self.provisional, self.check = presence, me, provisional, check
        reading = isinstance(workers, concurrent.futures.Future)
        self.pending, self.workers = (workers, None) if reading else (None, workers)
        if self.pending is not None:
            self.pending.add_done_callback(lambda _: ring())
        self.since = time.monotonic()

    def view(self, interrupted: threading.Event) -> dict:
        """The workers to announce on: the latest read, or the recent view while the first read is under way."""
        if self.pending is not None and time.monotonic() - self.since >= DHT_CALL_TIMEOUT:
            self.pending.cancel()
            raise AveragingError(f"the DHT did not answer a read of the run's workers within "
                                 f"{DHT_CALL_TIMEOUT:.0f}s")
        if self.pending is not None and (self.pending.done() or self.workers is None and self.provisional is None):
            self.workers, self.pending = records.wait_dht(self.pending, "get", interrupted=interrupted), None
            if self.check is not None:
                self.check(self.workers)
                self.check = None
        if self.workers is None and self.pending is None:
            self.workers = self.presence.live_workers()
        return self.workers if self.workers is not None else self.provisional

    def settled(self, announced) -> bool:
        """Whether anything may be decided: the read is in, or every other worker of the recent view has
        announced (a fresh read can then only add a worker that appeared since, which a read made a moment
        earlier would miss as well). Until then the next push, or the read under way, rings the doorbell."""
        if self.workers is None:
            others = set(self.provisional) - {self.me}
            if not others or not others <= set(announced):
                return False
            self.workers = self.provisional
        return True

    def read_in_background(self) -> None:
        if self.pending is None:
            self.pending, self.since = self.presence.read_live_workers(), time.monotonic()


class Matchmaker:
    def __init__(self, run_records: records.RunRecords, presence: Presence, settings: MatchmakingSettings,
                 codec_name: str, interrupted: threading.Event, *, doorbell: Doorbell | None = None,
                 push: Callable[[Sequence[str], str, int, list], None] | None = None,
                 joiners: Callable[[int], set[str]] | None = None, offenders: Offenders | None = None,
                 unreachable: Offenders | None = None, liveness: Unanswered | None = None,
                 breakers: Offenders | None = None):
        """``joiners(outer_step)``: peers that just downloaded this worker's state of that outer step
        (they are on their way to its round, possibly before their progress record can be read).
        ``offenders``: the peers this worker caught sending malformed data; ``unreachable``: those it could
        not dial; ``breakers``: those that broke an attempt of its (all three named in its announcements,
        the last two followed only where they leave a group big enough: ``match_rule.guarded_avoids``);
        ``liveness``: the peers found frozen (``frozen.py``), neither waited for nor grouped with, and the
        pings that find them."""
        self.records, self.presence, self.settings = run_records, presence, settings
        self.liveness = liveness
        self.joiners = joiners or (lambda outer_step: set())
        self.codec_name, self.interrupted = codec_name, interrupted
        self.me = presence.peer_id
        self.doorbell = doorbell or Doorbell()
        self.push = push
        """Sends these peers records of a round key and attempt, and rings their doorbells (without waiting):
        this worker's announcement to every peer that may group with it, a group it published (with its
        members' announcements) to every live worker (``pushed_records.py``)."""
        self.taken: set[str] = set()
        """Peers in groups of the current attempt that leave this worker out."""
        self._taken_for = ""
        self.offenders = offenders if offenders is not None else Offenders()
        self.unreachable = unreachable if unreachable is not None else UnreachablePeers()
        self.breakers = breakers if breakers is not None else Breakers()
        self._told = ""
        """The round key for which this worker was last told that members refuse it."""
        self.left_out: LeftOut | None = None
        """The group that last left this worker out (``BehindError``): what its catch-up waits for."""
        self._reading: dict[str, concurrent.futures.Future] = {}
        """Background DHT reads under way, by DHT key (``_refresh``)."""
        self.no_shows: dict[str, int] = {}
        """Peers that published a ready time and then did not come (by the round key they missed):
        their ready time is not believed again until they take part in a round."""

    def form_group(self, key: RoundKey, attempt: int, numel: int, suspects=frozenset(),
                   workers: dict | concurrent.futures.Future | None = None, *, provisional: dict | None = None,
                   check: Callable[[dict], None] | None = None) -> tuple[Group, int]:
        """Waits for the run's live workers to be ready for ``key``; returns (group, attempt).

        Announces, reads, asks ``match_rule.decide`` what to do, and waits until something changes.
        ``suspects`` (peers that broke an earlier attempt) are not waited for, but may still join.
        ``workers``: the live workers if the caller has just read them (saves a DHT read), or a read of
        them under way: then this worker announces at once, on what ``provisional`` (a recent view of
        them) says, and decides nothing before the read is in (so the announcement travels while the
        DHT answers); ``check`` is called with what that read returns.
        Raises ``BehindError`` when the run has moved past this worker.
        """
        s, me = self.settings, self.me
        self.left_out = None
        announce_key = self.records.round_key(key)
        began, announced, polls, rang, quiet, last_seen = self.records.clock.now(), None, 0, False, 0, frozenset()
        live = _LiveWorkers(self.presence, me, workers, provisional, check,
                            lambda: self.doorbell.ring(str(key), attempt))
        while True:
            self._raise_if_interrupted()  # a stopping worker neither announces nor publishes
            view = live.view(self.interrupted)
            self.presence.raise_if_behind(view, key.outer_step)
            # Peers push their announcements here (``pushed_records.py``); the DHT is read in the background
            # once this worker has announced, if nothing has come, and now and then (a push can be lost).
            ready = self._read_announcements(announce_key)
            if polls and not rang and polls % SLOW_READ_EVERY == 0:
                self._refresh(announce_key, key, attempt)
            attempt = next_attempt(ready, view, attempt, s.max_attempt_jump)
            gkey = self.records.group_key(key, attempt)
            if announced != attempt:
                mine, announced = self._announce(key, attempt, numel, began, set(view), set(ready)), attempt
            ready[me] = mine
            if not live.settled(ready):
                rang = self.doorbell.wait(str(key), attempt, self._gap(0))
                continue
            workers = live.workers
            if gkey != self._taken_for:
                self.taken, self._taken_for = set(), gkey
            # A leader may have closed the group already (it gave up on a straggler we still wait for): its
            # doorbell ring, or now and then the DHT, tells us.
            look = rang or self.doorbell.wait(str(key), attempt, 0) or (polls + 1) % 10 == 0
            if (polls + 1) % 10 == 0:
                self._refresh(gkey, key, attempt)
            frozen = self._frozen(workers)
            outcome = decide(self._view(
                key, attempt, numel, began, workers, ready, suspects=frozenset(suspects), frozen=frozen,
                joiners=frozenset(self.joiners(key.outer_step)), last_group=frozenset(self.presence.last_group),
                published=self._groups(gkey) if look else None), s)
            self._note(key, outcome.notes)
            self._probe(outcome.notes, workers)
            if isinstance(outcome, Close):
                self._closing(key, outcome, workers, frozen)
                went = self._adopt_group(key, attempt, numel, outcome.closing, workers, ready)
                if isinstance(went, Group):
                    return went, attempt
                log.info("round %s: %s, which would close the group of attempt %d, went on to attempt %d: "
                         "following it", key, went.leader[-8:], attempt, went.attempt)
                attempt = went.attempt  # its group of this attempt will never come: to the later one
                continue
            self._raise_if_interrupted()
            if not isinstance(outcome, Wait):
                return self._outcome(key, attempt, outcome), attempt
            polls += 1
            seen = frozenset((p, a.attempt) for p, a in ready.items())
            quiet, last_seen = (quiet + 1 if seen == last_seen else 0), seen
            if polls % SLOW_READ_EVERY == 0:  # read in the background, taken when in
                live.read_in_background()
            rang = self.doorbell.wait(str(key), attempt, self._gap(quiet))

    def _adopt_group(self, key: RoundKey, attempt: int, numel: int, closing: Closing, workers: dict,
                     ready: dict[str, Announcement]) -> Group | Follow:
        """Publishes the group if this worker leads it, else waits for the leader's (``match_rule.decide`` says
        which); or the later attempt that leader went on to."""
        s, me = self.settings, self.me
        gkey = self.records.group_key(key, attempt)
        announce_key = self.records.round_key(key)
        adopting = time.monotonic()
        deadline = adopting + s.straggler_wait + s.matchmaking_timeout
        polls, rang, fresh = 0, True, False
        while True:
            self._raise_if_interrupted()
            # A group already closed for this round wins over our own view of who is ready. Its leader
            # rings us when it publishes one; the DHT is read anyway now and then (a ring can be lost).
            if polls % SLOW_READ_EVERY == 0 and not rang:
                self._refresh(gkey, key, attempt)
            # A read of this attempt's groups still under way (made when nothing had been pushed here: this
            # worker came late, say) may bring a group that went ahead without it: publishing a group of the
            # same peers before it is in would only break this worker's attempt. Waited for a little only: a
            # DHT that does not answer must not stop a group that the pushes let form.
            reading = self._reading.get(gkey)
            closing = replace(closing, overdue=time.monotonic() > deadline, read_in=reading is None or
                              reading.done() or time.monotonic() - adopting > GROUP_READ_GRACE)
            look = rang or polls % SLOW_READ_EVERY == 0
            outcome = decide(self._view(key, attempt, numel, self.records.clock.now(), workers, ready,
                                        published=self._groups(gkey) if look else None, closing=closing,
                                        fresh=fresh, frozen=self._frozen(workers)), s)
            self._note(key, outcome.notes)
            fresh = False
            if isinstance(outcome, match_rule.Group) and outcome.publish:
                self._publish(key, attempt, gkey, outcome.members, set(workers) | {me})
                # read it back (a smaller leader wins), with what this look learned of who is ready
                closing, rang = replace(outcome.closing or closing, published_ours=True), True
                continue
            self._raise_if_interrupted()
            if not isinstance(outcome, Wait):
                return outcome if isinstance(outcome, Follow) else self._outcome(key, attempt, outcome)
            closing, polls = outcome.closing, polls + 1
            if polls % 10 == 0:  # now and then: has the run moved on, who is still alive, who announced?
                workers = self.presence.live_workers()
                self.presence.raise_if_behind(workers, key.outer_step)
                self._refresh(announce_key, key, attempt)
                ready, fresh = {**self._read_announcements(announce_key), me: ready[me]}, True
            rang = self.doorbell.wait(str(key), attempt, s.poll_interval)

    def _announce(self, key: RoundKey, attempt: int, numel: int, began: float, live: set[str],
                  announced: set[str]) -> Announcement:
        """Stores this worker's announcement of the attempt and pushes it to every peer that may group with it:
        the one that closes groups, and members that check a group against its members' announcements."""
        s, me = self.settings, self.me
        announce_key = self.records.round_key(key)
        value = {"attempt": attempt, "numel": numel, "codec": self.codec_name, "part": s.part_numel,
                 "config": s.config, "since": began, "avoid": self.offenders.active(key.outer_step),
                 "unreachable": self.unreachable.active(key.outer_step), "broke": self.breakers.active(key.outer_step),
                 "relayed": self._behind_nat()}
        record = self.records.store(announce_key, value, self.records.clock.now() + s.record_ttl, wait=False)
        to = (live | announced | self.joiners(key.outer_step)) - {me}
        if self.push is not None and to:
            self.push(sorted(to), str(key), attempt, [record])
        if not announced - {me}:  # nothing pushed yet: peers may have announced (or grouped) before we could hear
            self._refresh(announce_key, key, attempt)
            self._refresh(self.records.group_key(key, attempt), key, attempt)
        return Announcement.of(value, self._since_here(me, value))

    def _publish(self, key: RoundKey, attempt: int, gkey: str, members: Sequence[str], live: set[str]) -> None:
        """Stores the group this worker leads, and pushes it, with the announcements it is checked against (for a
        member that missed one), to the members and every other live worker: a group that leaves a worker out
        is what keeps it from closing its own."""
        s, me = self.settings, self.me
        record = self.records.store(gkey, list(members), self.records.clock.now() + s.record_ttl, wait=False)
        if self.push is not None:
            self.push(sorted((live | set(members)) - {me}), str(key), attempt,
                      [record] + self.records.records_of(self.records.round_key(key), list(members)))

    def _view(self, key: RoundKey, attempt: int, numel: int, began: float, workers: dict,
              ready: dict[str, Announcement], published: dict | None = None, **more) -> MatchView:
        """What ``decide`` looks at: the records read, their times on this worker's clock."""
        # Whose word counts is asked of the live workers and the announcers only: a published group names its
        # members in its publisher's words (a valid one names announcers alone), and a forged one must not mark
        # an absent partner seen.
        seen = set(workers) | set(ready) | {self.me}
        return MatchView(me=self.me, key=key, attempt=attempt, numel=numel, codec=self.codec_name,
                         now=self.records.clock.now(), began=began, workers=peers_here(workers, self.records.clock),
                         announcements=ready, trust=self.presence.partners.trust(seen), taken=frozenset(self.taken),
                         no_shows=frozenset(self.no_shows), behind_nat=self._behind_nat(), published=published, **more)

    def _note(self, key: RoundKey, notes: Notes) -> None:
        """Records what ``decide`` noted, and tells once per round key why this worker is left out of the group,
        when members refuse it."""
        if notes.taken is not None:
            self.taken = set(notes.taken)
        for p in notes.no_shows:
            self.no_shows[p] = key.outer_step
        if notes.refused_by and self._told != str(key):
            self._told = str(key)
            log.warning("round %s: left out of the group: %d member(s) refuse to average with this worker (%s): "
                        "their checks found data it sent malformed, they say (docs/trust.md)", key,
                        len(notes.refused_by), ", ".join(p[-8:] for p in notes.refused_by))

    def _probe(self, notes: Notes, workers: dict) -> None:
        """Is what we wait for alive? (the frozen are asked again: back?) A peer behind NAT only once its record
        missed a heartbeat: a ping through a relay may fail for a live peer."""
        if self.liveness is not None:
            relayed = {p for p in notes.probe if workers[p].relays}
            self.liveness.probe(notes.probe - (relayed - self._quiet(workers, relayed)), controls=list(notes.controls),
                                relayed=relayed)

    def _closing(self, key: RoundKey, close: Close, workers: dict, frozen: frozenset[str]) -> None:
        """Before a group closes: a group of one only where this worker is not cut off from the run; why each live
        worker left out of it is (what its record said)."""
        isolated = (self.records.clock.isolated() or self.presence.cut_off()) if close.alone else None
        if isolated:
            raise AveragingError(f"round {key}: not applied alone: {isolated}")
        left = set(workers) - close.members
        if left:
            now = self.records.clock.now()
            log.info("round %s: a group of %d without %s", key, len(close.members), ", ".join(
                f"{p[-8:]} (heading {workers[p].heading}, at {workers[p].outer_step}, "
                f"{'waited for until %+.2fs' % (close.until - now) if p in close.missing else 'not waited for'}"
                f"{', no-show' if p in self.no_shows else ''}{', frozen' if p in frozen else ''})"
                for p in sorted(left)))

    def _outcome(self, key: RoundKey, attempt: int, outcome: match_rule.Group | Fail) -> Group:
        """The group to adopt, or the error a failed attempt raises."""
        if isinstance(outcome, match_rule.Group):
            for m in outcome.members:  # it took part: its next ready time is believed again
                self.no_shows.pop(m, None)
            relayed = outcome.relayed
            return Group(make_group_id(self.settings.run_id, key, attempt, outcome.members, relayed),
                         outcome.members, key, relayed, attempt)
        if outcome.forget_unreachable:  # its own names lapse: left alone by them, it tries those peers again
            self.unreachable.forget(outcome.forget_unreachable)
        if outcome.left_out is not None:
            self.left_out = LeftOut(key, attempt, outcome.left_out)
        if outcome.behind:
            raise BehindError(outcome.message, group_outer_step=key.outer_step + 1)
        raise AveragingError(outcome.message)

    def _gap(self, quiet: int) -> float:
        """Seconds to the next look after ``quiet`` looks that found the same announcements."""
        s = self.settings
        return min(max(s.poll_interval, s.quiet_poll_interval), s.poll_interval * 2 ** min(quiet, 30))

    def _refresh(self, dht_key: str, key: RoundKey, attempt: int) -> None:
        """Reads ``dht_key`` from the DHT in the background (one read at a time per key); once it is in, the
        doorbell of (``key``, ``attempt``) rings, so a waiting loop looks at what it brought."""
        reading = self._reading.get(dht_key)
        if reading is not None and not reading.done():
            return
        for old in [k for k, f in self._reading.items() if f.done()]:
            del self._reading[old]
        self._reading[dht_key] = self.records.refresh(dht_key, lambda: self.doorbell.ring(str(key), attempt))

    def _announcements(self, announce_key: str, fresh: bool = False) -> dict[str, dict]:
        """The valid announcements under ``announce_key``: as pushed and read so far (``RunRecords.view``),
        or, with ``fresh``, read from the DHT now."""
        return {p: v for p, v in self.records.subkey_values(announce_key, self.settings.record_ttl + 10,
                                                            fresh=fresh).items()
                if isinstance(v, dict) and type(v.get("attempt")) is int and v["attempt"] >= 0}

    def _read_announcements(self, announce_key: str) -> dict[str, Announcement]:
        """``_announcements`` as the rule reads them (their start on this worker's clock)."""
        return {p: Announcement.of(v, self._since_here(p, v)) for p, v in self._announcements(announce_key).items()}

    def _since_here(self, peer: str, value: dict) -> float | None:
        since = value.get("since")
        if not isinstance(since, (int, float)) or isinstance(since, bool):
            return None
        return self.records.clock.in_mine(peer, since)

    def _groups(self, gkey: str) -> dict:
        """The groups published for an attempt, by publisher: pushed here or read so far (``_refresh``)."""
        return self.records.subkey_values(gkey, self.settings.record_ttl + 10, fresh=False)

    def left_out_for_nothing(self, left: LeftOut) -> str | None:
        """Why the round that left this worker out will not move the run on, or None while it may: its
        members announced a later attempt at the same round (theirs failed) or have all gone. A worker
        left out waits to catch up with the group's result; a group that failed has none to give, and
        its members come back to matchmaking, where they would wait for this worker."""
        workers = self.presence.live_workers()
        if not left.members & set(workers):
            return f"every member of the group of round {left.key} that left this worker out is gone"
        ready = self._announcements(self.records.round_key(left.key), fresh=True)
        again = sorted(p for p in left.members if p in ready and ready[p]["attempt"] > left.attempt)
        if again:
            return (f"the group of round {left.key} that left this worker out did not complete it "
                    f"({len(again)} of its members try again)")
        return None

    def _frozen(self, workers: dict) -> frozenset[str]:
        """The peers found frozen (``frozen.Unanswered``), less those behind NAT whose record is fresh: a
        heartbeat proves them alive, whatever a ping through a relay said."""
        if self.liveness is None:
            return frozenset()
        found = self.liveness.frozen()
        relayed = {p for p in found if p in workers and workers[p].relays}
        alive = relayed - self._quiet(workers, relayed)
        if alive:
            self.liveness.back(alive)
        return found - alive

    def _quiet(self, workers: dict, peers: set[str]) -> set[str]:
        """Those of ``peers`` whose record has missed a heartbeat (``RELAYED_QUIET_S``)."""
        clock = self.records.clock
        now = clock.now()
        return {p for p in peers if now - clock.in_mine(p, workers[p].time) >= RELAYED_QUIET_S}

    def _behind_nat(self) -> bool:
        """Whether this worker is reached only through relays (it holds slots on some: ``relays.py``)."""
        return bool(getattr(self.presence, "relays", ()))

    def _raise_if_interrupted(self) -> None:
        if self.interrupted.is_set():
            raise Interrupted("the worker is stopping: round abandoned")


def peers_here(workers: dict, clock) -> dict[str, Peer]:
    """Live workers' records as ``match_rule`` reads them: their ready times on this worker's ``clock``."""
    return {p: Peer(r.outer_step, r.heading, None if r.ready_at is None else clock.in_mine(p, r.ready_at), r.time)
            for p, r in workers.items()}
