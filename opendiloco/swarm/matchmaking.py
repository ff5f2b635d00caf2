"""Matchmaking: who averages together for a round key, decided through the DHT and pushed records.

Each worker announces it is ready for round ``k`` (attempt ``a``). When every live worker of the
run at that outer step is ready (or the ones still missing are past the ready time they published,
plus ``straggler_wait``, with at least ``min_group_size`` ready), the ready peer with the smallest
id closes the group and publishes its members; everyone adopts the group published under the
smallest id, so no two views split the run. A group never holds both a member and a peer that member
avoids (it caught it sending malformed data, or could not dial it: ``exclusion.py``); who is left out
is decided from the announcements, the same way on every member.
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
from dataclasses import dataclass

from ..comm.base import RoundKey
from ..comm.group import Group, make_group_id
from ..errors import AveragingError, BehindError, Interrupted
from . import records
from .exclusion import (
    Breakers,
    Offenders,
    UnreachablePeers,
    announced_avoid,
    conflict_free,
    conflicts,
    part_of,
    partition,
)
from .frozen import RELAYED_QUIET_S, Unanswered
from .presence import Presence

log = logging.getLogger(__name__)


@dataclass
class MatchmakingSettings:
    run_id: str
    min_group_size: int = 1
    matchmaking_timeout: float = 30.0
    straggler_wait: float = 10.0
    """Grace beyond a peer's published ready time (or from the start, for a peer without one)."""
    max_wait: float = 600.0
    record_ttl: float = 60.0
    """How long announcements and published groups stay in the DHT."""
    poll_interval: float = 0.02
    quiet_poll_interval: float = 0.25
    """While the announcements stay the same, the gap between two looks doubles from ``poll_interval``
    up to this: each look is a DHT lookup that the peers' DHT processes answer, and a worker waiting
    for a straggler at one look each 20 ms cost its peers and itself half a core of the 2 here."""
    part_numel: int = 1 << 18
    """Values per streamed part: members must agree on it (it is part of the announcement)."""
    config: str = ""
    """The config fingerprint: like the codec label, only announcements that carry ours are grouped."""
    max_attempt_jump: int = 8
    """An announced attempt number more than this ahead of ours is ignored."""


GROUP_READ_GRACE = 2.0
"""Seconds a worker about to publish a group waits for a read of the attempt's groups still under way
(about two round trips, where the DHT answers)."""

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


def in_round(record, outer_step: int) -> bool:
    """Whether a peer's record says its round ``outer_step`` is in flight: it has started that round (a
    streamed round runs in the background) and heads for the next. Its announcement of the round may
    not have reached the DHT yet, but it is in the round: it is waited for, for ``straggler_wait`` (its
    published ready time is for the round after), and not held to that time if it does not come."""
    return record.outer_step == outer_step and record.heading == outer_step + 1


@dataclass(frozen=True)
class LeftOut:
    """A group of this round and attempt, of these members, went ahead without this worker."""

    key: RoundKey
    attempt: int
    members: frozenset[str]


class LeaderWentOn(Exception):
    """The peer a worker waits for to publish the group of its attempt has announced a later attempt."""

    def __init__(self, leader: str, attempt: int):
        super().__init__(f"{leader[-8:]} went on to attempt {attempt}")
        self.leader, self.attempt = leader, attempt


def guarded_avoids(candidates: set[str], refusals: dict, unreachables: dict, broken: dict,
                   min_group_size: int) -> dict[str, frozenset[str]]:
    """What the candidates' announcements keep apart, the same on every member from the announcements alone.

    ``avoid`` names (malformed data) always count. ``unreachable`` names count only where they leave some
    part big enough for a group (two or more, and ``min_group_size``): else nobody averages, the outer step,
    which lapses the names, never moves, and they bind for ever. ``broke`` names (``Breakers``) count only
    where, on top of those, the largest part still holds more than half of the candidates: a member that
    lost its own connections takes the others for the breakers (they gave up on it, blaming it), and
    following its names would split the run into parts that each hold their rounds as the smaller side of a
    partition would (the CI scenario, once); one insider among honest members is always a minority."""
    none: frozenset[str] = frozenset()
    kept = {p: refusals.get(p, none) for p in candidates}
    big_enough = max(2, min_group_size)
    with_unreachable = {p: kept[p] | unreachables.get(p, none) for p in candidates}
    if max(map(len, partition(candidates, with_unreachable)), default=0) >= big_enough:
        kept = with_unreachable
    with_broken = {p: kept[p] | broken.get(p, none) for p in candidates}
    largest = max(map(len, partition(candidates, with_broken)), default=0)
    if largest >= big_enough and 2 * largest > len(candidates):
        kept = with_broken
    return kept


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
        the last two followed only where they leave a group big enough: ``_set_avoids``); ``liveness``:
        the peers found frozen (``frozen.py``), neither waited for nor grouped with, and the pings that find
        them."""
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
        self.avoids: dict[str, frozenset[str]] = {}
        """The peers each peer that announced the current attempt keeps out of its group (its
        announcement's ``avoid`` and ``unreachable``)."""
        self.refusals: dict[str, frozenset[str]] = {}
        """Of those, the peers each one names for malformed data (its ``avoid``)..."""
        self.unreachables: dict[str, frozenset[str]] = {}
        """...and those it could not dial (its ``unreachable``)..."""
        self.broken: dict[str, frozenset[str]] = {}
        """...and those that broke an attempt of its (its ``broke``)."""
        self.relayed: dict[str, bool] = {}
        """Whether each peer that announced the current attempt is reached only through relays (its
        announcement's ``relayed``): such a member owns an empty shard (``shard_bounds_for``)."""
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
        began, announced, polls = self.records.clock.now(), None, 0
        rang, quiet, last_seen = False, 0, frozenset()
        mine_avoid: frozenset[str] = frozenset()
        mine_unreachable: frozenset[str] = frozenset()  # what we announced for this attempt, read back or not
        mine_broke: frozenset[str] = frozenset()
        gkey = self.records.group_key(key, attempt)
        pending, workers = (workers, None) if isinstance(workers, concurrent.futures.Future) else (None, workers)
        if pending is not None:
            pending.add_done_callback(lambda _: self.doorbell.ring(str(key), attempt))
        pending_since = time.monotonic()
        while True:
            self._raise_if_interrupted()  # a stopping worker neither announces nor publishes
            # A read of the live workers under way is taken once it is in, or at once when there is no earlier
            # view to announce on; one overdue fails the round, as a read made in place would.
            if pending is not None and time.monotonic() - pending_since >= records.DHT_CALL_TIMEOUT:
                pending.cancel()
                raise AveragingError(f"the DHT did not answer a read of the run's workers within "
                                     f"{records.DHT_CALL_TIMEOUT:.0f}s")
            if pending is not None and (pending.done() or workers is None and provisional is None):
                workers, pending = records.wait_dht(pending, "get", interrupted=self.interrupted), None
                if check is not None:
                    check(workers)
                    check = None
            if workers is None and pending is None:
                workers = self.presence.live_workers()
            view = workers if workers is not None else provisional
            self.presence.raise_if_behind(view, key.outer_step)
            # Peers push their announcements here (``pushed_records.py``); the DHT is read in the background
            # once this worker has announced, if nothing has come, and now and then (a push can be lost).
            ready = self._announcements(announce_key)
            if polls and not rang and polls % SLOW_READ_EVERY == 0:
                self._refresh(announce_key, key, attempt)
            # An attempt number only counts if a live worker of the run announced it (no peer can
            # push the run to attempt 10**9 and out of its retries).
            attempt = max([attempt] + [v["attempt"] for p, v in ready.items() if p in view
                                       and v["attempt"] <= attempt + s.max_attempt_jump])
            gkey = self.records.group_key(key, attempt)
            if announced != attempt:
                value = {"attempt": attempt, "numel": numel, "codec": self.codec_name, "part": s.part_numel,
                         "config": s.config, "since": began, "avoid": self.offenders.active(key.outer_step),
                         "unreachable": self.unreachable.active(key.outer_step),
                         "broke": self.breakers.active(key.outer_step),
                         "relayed": self._behind_nat()}
                record = self.records.store(announce_key, value, self.records.clock.now() + s.record_ttl, wait=False)
                ready[me], announced, mine_avoid = value, attempt, announced_avoid(value)
                mine_unreachable, mine_broke = announced_avoid(value, "unreachable"), announced_avoid(value, "broke")
                # To every peer that may group with us: the one that closes groups, and members that check a
                # group against its members' announcements.
                to = (set(view) | set(ready) | self.joiners(key.outer_step)) - {me}
                if self.push is not None and to:
                    self.push(sorted(to), str(key), attempt, [record])
                if not set(ready) - {me}:  # nothing pushed yet: peers may have announced (or grouped) before
                    self._refresh(announce_key, key, attempt)  # we could hear
                    self._refresh(self.records.group_key(key, attempt), key, attempt)
            if workers is None:
                # Once every other worker of the recent view has announced this round, a fresh read can only
                # add a worker that appeared since, which a read made a moment earlier would miss as well.
                # Until then nothing is decided: the next push, or the read under way, rings the doorbell.
                others = set(provisional) - {me}
                if not others or not others <= set(ready):
                    rang = self.doorbell.wait(str(key), attempt, self._gap(0))
                    continue
                workers = provisional
            if gkey != self._taken_for:
                self.taken, self._taken_for = set(), gkey
            # An announcement outlives its round in the DHT: a peer that has applied this round
            # has done it, and must not be grouped with by a worker that arrives late.
            announced_ok = self._compatible(ready, attempt, numel) - self._moved_on(workers, key)
            self.refusals = {p: announced_avoid(ready[p]) for p in announced_ok}
            self.unreachables = {p: announced_avoid(ready[p], "unreachable") for p in announced_ok}
            self.broken = {p: announced_avoid(ready[p], "broke") for p in announced_ok}
            self.refusals[me], self.unreachables[me], self.broken[me] = mine_avoid, mine_unreachable, mine_broke
            self._set_avoids(announced_ok | {me})
            self.relayed = {p: ready[p].get("relayed") is True for p in announced_ok}
            self.relayed[me] = self._behind_nat()
            frozen = self._frozen(workers)
            compatible = announced_ok - (self.taken - {me}) - self._gone(workers, ready, key) - frozen
            mine = part_of(me, compatible, self.avoids)  # without peers that members of it avoid
            self._tell_if_refused(key, compatible)
            # Peers heading for this round: at its outer step, or one behind with a streamed round
            # still in flight that they will apply before they come. Peers already in a group that
            # leaves us out are not waited for. Peers that just downloaded our state of this step
            # come too, whatever their record says yet.
            joiners = self.joiners(key.outer_step)
            in_flight = {p for p, r in workers.items() if in_round(r, key.outer_step)}
            # Members of this worker's last round whose record has not caught up with it yet (it says they are
            # one step behind, still heading there): they come as we did. Their ready time is stale too.
            in_flight |= {p for p in self.presence.last_group - {me} if p in workers and
                          workers[p].outer_step == key.outer_step - 1 and workers[p].heading < key.outer_step}
            heading = {p for p, r in workers.items() if r.heading == key.outer_step} | in_flight
            heading |= {p for p in joiners if p not in workers or workers[p].heading < key.outer_step}
            expected = (heading - set(suspects) - self.taken - frozen) | {me}
            # A peer that would be left out of our group even if it came now is not waited for.
            missing = {p for p in expected - compatible if p in part_of(me, compatible | {p}, self.avoids)}
            if self.liveness is not None:  # is what we wait for alive? (the frozen are asked again: back?)
                asked = {p for p in missing | (frozen & heading) if p in workers}
                relayed = {p for p in asked if workers[p].relays}
                self.liveness.probe(asked - (relayed - self._quiet(workers, relayed)),
                                    controls=[p for p in sorted(compatible - {me}) if not self.relayed.get(p)],
                                    relayed=relayed)
            enough = len(mine) >= s.min_group_size
            now = self.records.clock.now()
            # Everyone measures from the earliest announcement, so that the leader and the members
            # give up on a straggler at the same moment.
            shared = self._shared_start({p: ready[p] for p in compatible}, began, now)
            # A ready time is believed in full only from a peer whose word counts here; from any other peer,
            # a joiner that has just downloaded our state included, for one grace at most (``partners.py``):
            # a fresh identity that asks for a state manifest would otherwise hold every round to max_wait.
            believable = self.presence.partners.vouched(set(workers) | {me}) & missing
            # A peer with the round in flight gets the grace only: its ready time is for the round after.
            give_up_at = max((self._wait_until(None if p in in_flight else workers.get(p), shared, p in believable)
                              for p in missing), default=shared)
            if enough and now >= give_up_at:
                for p in missing - in_flight:  # it promised a time and is not here: its next promise is not believed
                    if p in workers and workers[p].ready_at is not None:
                        self.no_shows[p] = key.outer_step
                others = set(workers) - {me}
                if mine == {me} and others:
                    refusing = self._refusing(compatible)
                    if refusing:
                        raise AveragingError(f"round {key}: left out of the group: {len(refusing)} member(s) refuse to "
                                             f"average with this worker, naming it for malformed data "
                                             f"({', '.join(p[-8:] for p in refusing)}); not applied alone")
                    # Alone while the run has other live workers: a round of one would fork θ_global
                    # from theirs. If they are all past this round, this worker is the one behind;
                    # else (joining, catching up, behind a slow link) the work is kept and goes into
                    # the next round (under pace "swarm"), with whoever is there then.
                    if all(workers[p].heading > key.outer_step for p in others):
                        raise BehindError(f"alone in round {key}: every other worker is past it",
                                          group_outer_step=key.outer_step + 1)
                    apart = self._apart(compatible)
                    if apart:  # its own names lapse now: left alone by them, it tries those peers again next time
                        self.unreachable.forget(apart)
                        raise AveragingError(f"round {key}: left out of the group: this worker and {len(apart)} "
                                             f"member(s) could not dial each other "
                                             f"({', '.join(p[-8:] for p in apart)}); not applied alone")
                    raise AveragingError(f"round {key}: no other worker was ready in time ({len(others)} other "
                                         "live worker(s) in the run); not applied alone")
                isolated = (self.records.clock.isolated() or self.presence.cut_off()) if mine == {me} else None
                if isolated:
                    raise AveragingError(f"round {key}: not applied alone: {isolated}")
                left = set(workers) - mine
                if left:  # why a live worker is not in this group: what its record said
                    log.info("round %s: a group of %d without %s", key, len(mine), ", ".join(
                        f"{p[-8:]} (heading {workers[p].heading}, at {workers[p].outer_step}, "
                        f"{'waited for until %+.2fs' % (give_up_at - now) if p in missing else 'not waited for'}"
                        f"{', no-show' if p in self.no_shows else ''}{', frozen' if p in frozen else ''})"
                        for p in sorted(left)))
                try:
                    return self._adopt_group(key, attempt, announced_ok, set(workers) | {me}, numel), attempt
                except LeaderWentOn as went:  # its group of this attempt will never come: to the later one
                    log.info("round %s: %s, which would close the group of attempt %d, went on to attempt %d: "
                             "following it", key, went.leader[-8:], attempt, went.attempt)
                    attempt = went.attempt
                    continue
            self._raise_if_interrupted()
            if not enough and now >= max(shared + s.matchmaking_timeout, give_up_at):
                raise AveragingError(f"matchmaking for round {key}: {len(compatible)} peer(s) ready "
                                     f"after {now - shared:.0f}s, need {s.min_group_size}")
            polls += 1
            # A leader may have closed the group already (it gave up on a straggler we still wait
            # for): its doorbell ring, or now and then the DHT, tells us.
            if polls % 10 == 0:
                self._refresh(gkey, key, attempt)
            if rang or self.doorbell.wait(str(key), attempt, 0) or polls % 10 == 0:
                members = self._published(key, attempt, gkey, set(workers) | {me}, announced_ok)
                if members is not None:
                    return self._group(key, attempt, members), attempt
            seen = frozenset((p, v["attempt"]) for p, v in ready.items())
            quiet, last_seen = (quiet + 1 if seen == last_seen else 0), seen
            if polls % SLOW_READ_EVERY == 0 and pending is None:  # read in the background, taken when in
                pending, pending_since = self.presence.read_live_workers(), time.monotonic()
            rang = self.doorbell.wait(str(key), attempt, self._gap(quiet))

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

    def _compatible(self, ready: dict[str, dict], attempt: int, numel: int) -> set[str]:
        s = self.settings
        return {p for p, v in ready.items() if v.get("attempt") == attempt and v.get("numel") == numel
                and v.get("codec") == self.codec_name and v.get("part") == s.part_numel
                and v.get("config", "") == s.config}

    def _gone(self, workers: dict, announcements: dict[str, dict], key: RoundKey) -> set[str]:
        """Peers that announced this round and are no longer in it: their record is gone (dead, or
        left), or was written after their announcement and says they head for an earlier round (they
        went back, to catch up or heal drift). Neither leads a group nor is waited for as if ready; a
        record older than the announcement says nothing yet."""
        out = set()
        for p, v in announcements.items():
            rec = workers.get(p)
            since = v.get("since") if isinstance(v, dict) else None
            if p != self.me and (rec is None or (rec.heading < key.outer_step and isinstance(since, (int, float))
                                                 and rec.time > since)):
                out.add(p)
        return out

    def _moved_on(self, workers: dict, key: RoundKey) -> set[str]:
        """Peers that have applied this round already (their announcement of it may still be read)."""
        return {p for p, r in workers.items() if r.outer_step > key.outer_step} - {self.me}

    def _wait_until(self, record, began: float, vouched: bool = True) -> float:
        """Until when (DHT time) a live peer that is not ready yet is waited for.

        Its own published ready time plus ``straggler_wait`` of grace (a 4x slower peer says it
        comes 4x later, and is waited for); ``straggler_wait`` from the start of matchmaking for
        a peer that published none or did not come when it promised; never more than ``max_wait``.
        A peer whose word does not count here (``vouched`` False: ``partners.py``) is believed for
        one ``straggler_wait`` at most, so however many identities a no-show uses, a round waits for
        the unvouched ones ``2 * straggler_wait`` at most. A dead peer
        stops being waited for when its record expires, a hung one when its ready time has passed.
        """
        s = self.settings
        believed = record is not None and record.ready_at is not None and record.peer_id not in self.no_shows
        expected = self.records.clock.in_mine(record.peer_id, record.ready_at) if believed else began
        if not vouched:  # believed for one grace at most: an honest newcomer that joined through another member
            expected = min(expected, began + s.straggler_wait)
        return min(max(expected, began) + s.straggler_wait, began + s.max_wait)

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
        """Those of ``peers`` whose record has missed a heartbeat (``frozen.RELAYED_QUIET_S``)."""
        clock = self.records.clock
        now = clock.now()
        return {p for p in peers if now - clock.in_mine(p, workers[p].time) >= RELAYED_QUIET_S}

    def _shared_start(self, announcements: dict, began: float, now: float) -> float:
        """The earliest plausible ``since`` among compatible announcements (ours if none is)."""
        oldest = now - self.settings.max_wait - self.settings.matchmaking_timeout
        clock = self.records.clock
        times = [clock.in_mine(p, v["since"]) for p, v in announcements.items()
                 if isinstance(v.get("since"), (int, float)) and not isinstance(v["since"], bool)]
        return min([began] + [t for t in times if oldest <= t <= now])

    def _published(self, key: RoundKey, attempt: int, gkey: str, live: set[str],
                   announced: set[str]) -> tuple[str, ...] | None:
        """The group published for this round and attempt that holds this worker, or None.

        A group counts if its publisher leads it (the smallest member id), its members are
        distinct, every one of them announced this attempt with our settings (``announced``), none
        of them avoids another (``self.avoids``), and some of them are alive; of several holding us,
        the smallest publisher's wins. Records are signed, so a publisher can only speak for itself.
        Groups are those pushed here or read so far (``_refresh`` reads the DHT).

        Groups that leave this worker out are other workers' business (``self.taken`` notes their
        members, so nobody waits for them here), unless together they are at least half the run's
        live workers whose word counts here (``partners.py``): then the run moves on without us
        (``BehindError``: catch up to it).
        """
        published = {p: tuple(sorted(set(m))) for p, m in
                     self.records.subkey_values(gkey, self.settings.record_ttl + 10, fresh=False).items()
                     if isinstance(m, list) and m and all(isinstance(x, str) for x in m)
                     and len(set(m)) == len(m) and p == min(m) and live & set(m) and set(m) <= announced
                     and not conflicts(m, self.avoids)}
        holding_me = {p: m for p, m in published.items() if self.me in m}
        if holding_me:
            members = holding_me[min(holding_me)]
            self._took_part(members)
            return members
        self.taken = set().union(*published.values()) if published else set()
        voters = self.presence.partners.vouched(live | self.taken)  # fresh identities do not count
        if self.taken & voters and 2 * len(self.taken & voters) >= len(voters):
            self.left_out = LeftOut(key, attempt, frozenset(self.taken))
            raise BehindError(f"left out of the group for round {key}", group_outer_step=key.outer_step + 1)
        return None

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

    def _refusing(self, candidates: set[str]) -> list[str]:
        """The candidates whose announcements avoid this worker."""
        return sorted(p for p in candidates if self.me in self.refusals.get(p, ()))

    def _set_avoids(self, candidates: set[str]) -> None:
        """``avoids``: what the candidates' announcements keep apart. Names of unreachable peers count only
        where they leave some part big enough for a group (two or more, and ``min_group_size``): else
        nobody averages, the outer step, which lapses the names, never moves, and they bind for ever
        (two workers whose link broke once; three behind one failed dial in a run that needs all
        three). The same on every member, from the announcements alone."""
        self.avoids = guarded_avoids(candidates, self.refusals, self.unreachables, self.broken,
                                     self.settings.min_group_size)

    def _apart(self, candidates: set[str]) -> list[str]:
        """The candidates kept apart from this worker because one of the two could not dial the other."""
        mine = self.unreachables.get(self.me, frozenset())
        return sorted(p for p in candidates - {self.me} if self.me in self.unreachables.get(p, ()) or p in mine)

    def _tell_if_refused(self, key: RoundKey, candidates: set[str]) -> None:
        """Says once per round key why this worker is left out of the group, when members refuse it."""
        refusing = self._refusing(candidates)
        if refusing and self._told != str(key) and self.me not in conflict_free(candidates, self.avoids):
            self._told = str(key)
            log.warning("round %s: left out of the group: %d member(s) refuse to average with this worker (%s): "
                        "their checks found data it sent malformed, they say (docs/trust.md)", key, len(refusing),
                        ", ".join(p[-8:] for p in refusing))

    def _took_part(self, members) -> None:
        for m in members:
            self.no_shows.pop(m, None)

    def _behind_nat(self) -> bool:
        """Whether this worker is reached only through relays (it holds slots on some: ``relays.py``)."""
        return bool(getattr(self.presence, "relays", ()))

    def _group(self, key: RoundKey, attempt: int, members: tuple[str, ...]) -> Group:
        relayed = frozenset(m for m in members if self.relayed.get(m))
        return Group(make_group_id(self.settings.run_id, key, attempt, members, relayed), members, key, relayed,
                     attempt)

    def _adopt_group(self, key: RoundKey, attempt: int, compatible: set[str], live: set[str], numel: int) -> Group:
        """Publishes the group if this worker leads it (the smallest id of those ready and not taken),
        else waits for the leader's; ``compatible``: the peers that announced this attempt with our settings."""
        s, me = self.settings, self.me
        gkey = self.records.group_key(key, attempt)
        announce_key = self.records.round_key(key)
        adopting = time.monotonic()
        deadline = adopting + s.straggler_wait + s.matchmaking_timeout
        polls = 0
        published_ours, rang = False, True
        gone = compatible - live  # a leader that died or went back is not waited for (``_gone``)
        while True:
            self._raise_if_interrupted()
            # A group already closed for this round wins over our own view of who is ready. Its leader
            # rings us when it publishes one; the DHT is read anyway now and then (a ring can be lost).
            if polls % SLOW_READ_EVERY == 0 and not rang:
                self._refresh(gkey, key, attempt)
            if rang or polls % SLOW_READ_EVERY == 0:
                members = self._published(key, attempt, gkey, live, compatible)
                if members is not None:
                    return self._group(key, attempt, members)
            candidates = part_of(me, compatible - (self.taken - {me}) - gone, self.avoids)
            if len(candidates) < s.min_group_size:
                raise AveragingError(f"round {key}: {len(candidates)} peer(s) left for a group, need "
                                     f"{s.min_group_size}")
            if candidates == {me} and compatible - {me}:
                # It came here with others ready, and they are gone, grouped without it, or moved on. Whether it
                # may average alone is for the next attempt's ``form_group`` to decide (a round of one while
                # other workers live, or while cut off from the run, would fork θ_global).
                raise AveragingError(f"round {key}: the {len(compatible - {me})} other peer(s) ready for the round "
                                     "left it or were grouped without this worker before its group closed; "
                                     "not applied alone")
            # A read of this attempt's groups still under way (made when nothing had been pushed here: this
            # worker came late, say) may bring a group that went ahead without it: publishing a group of the
            # same peers before it is in would only break this worker's attempt. Waited for a little only: a
            # DHT that does not answer must not stop a group that the pushes let form.
            reading = self._reading.get(gkey)
            read_in = reading is None or reading.done() or time.monotonic() - adopting > GROUP_READ_GRACE
            if not published_ours and min(candidates) == me and read_in:
                members = sorted(candidates)
                record = self.records.store(gkey, members, self.records.clock.now() + s.record_ttl, wait=False)
                # To the members, with the announcements it is checked against (for a member that missed one), and to
                # every other live worker: a group that leaves a worker out is what keeps it from closing its own.
                if self.push is not None:
                    self.push(sorted((live | set(members)) - {me}), str(key), attempt,
                              [record] + self.records.records_of(announce_key, members))
                published_ours = rang = True  # read it back: a concurrent leader with a smaller id would win
                continue
            self._raise_if_interrupted()
            if time.monotonic() > deadline:
                raise AveragingError(f"no group was published for round {key}")
            polls += 1
            if polls % 10 == 0:  # now and then: has the run moved on, who is still alive, who announced?
                workers = self.presence.live_workers()
                self.presence.raise_if_behind(workers, key.outer_step)
                live = set(workers) | {me}
                self._refresh(announce_key, key, attempt)
                announcements = self._announcements(announce_key)
                compatible |= self._compatible(announcements, attempt, numel)
                compatible -= self._moved_on(workers, key)
                self.refusals.update({p: announced_avoid(announcements[p]) for p in compatible if p in announcements})
                self.unreachables.update({p: announced_avoid(announcements[p], "unreachable") for p in compatible
                                          if p in announcements})
                self.broken.update({p: announced_avoid(announcements[p], "broke") for p in compatible
                                    if p in announcements})
                self._set_avoids(compatible | {me})
                self.relayed.update({p: announcements[p].get("relayed") is True for p in compatible
                                     if p in announcements and p != me})
                gone = self._gone(workers, {p: announcements.get(p) for p in compatible}, key)
                self._raise_if_leader_went_on(announcements, candidates, attempt)
            rang = self.doorbell.wait(str(key), attempt, s.poll_interval)

    def _raise_if_leader_went_on(self, announcements: dict[str, dict], candidates: set[str], attempt: int) -> None:
        """``LeaderWentOn`` if the candidate that would publish this attempt's group (the smallest) announced a
        later attempt: it took another leader's group of this attempt, or failed one, and publishes none here.
        Where leaders disagree on who is ready (one took a peer for frozen that another grouped), its members
        waited for a group that never came until the run moved on without them: 15 s of the whole run after a
        new address in the long world scenario."""
        leader = min(candidates)
        later = announcements.get(leader, {}).get("attempt", attempt)
        if leader != self.me and attempt < later <= attempt + self.settings.max_attempt_jump:
            raise LeaderWentOn(leader, later)

    def _raise_if_interrupted(self) -> None:
        if self.interrupted.is_set():
            raise Interrupted("the worker is stopping: round abandoned")
