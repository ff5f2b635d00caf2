"""The matchmaking rule: for one round key and attempt, whom a worker waits for, groups with, or gives up on.

``decide(view, settings)`` is the whole rule, a pure function of what a worker has seen (``MatchView``): no
threads, clocks, I/O or DHT. ``Matchmaker`` (``matchmaking.py``) reads the records, builds the view, calls
it at every look, and does what the answer says: waits (``Wait``), closes the group (``Close``), publishes or
adopts one (``Group``), follows the peer that would close it to a later attempt (``Follow``), or fails the
attempt (``Fail``). What it has to record or ask on the way (no-shows, pings, the members that refuse this
worker, the peers already grouped without it) comes back as data (``Notes``).

The rule, in the order ``decide`` applies it:

- An announcement counts if it is of this attempt, with this worker's settings (size, codec, part size,
  config), from a peer that has not applied the round already (``announced_ok``). Which of its names keep
  members apart is ``guarded_avoids``; who is left out of a group is ``exclusion.partition``.
- While gathering, a live worker heading for the round (at its outer step, one behind with the round in
  flight, a member of the last round whose record lags, a joiner that just took this worker's state) is
  waited for, unless it broke an earlier attempt, was grouped without this worker, is frozen, or would be
  left out even if it came. Each is waited for until ``wait_until``: its ready time plus ``straggler_wait``,
  measured from the earliest announcement (so that the leader and members give up together).
- Once nobody is waited for and the group is big enough (``min_group_size``), the group closes. It never
  closes as a group of one while the run has other live workers (``Fail``: ``BehindError`` when every
  other worker is past the round, else ``AveragingError``: the work is carried), nor while this worker may
  be cut off (``Close.alone``: the loop asks).
- Closing: the smallest of the candidates publishes them; the others adopt the group published under the
  smallest id (``published_group``); a peer that would publish and announced a later attempt is followed.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from ..comm.base import RoundKey
from .exclusion import announced_avoid, conflict_free, conflicts, part_of, partition

if TYPE_CHECKING:
    from .partners import Trust

NONE: frozenset[str] = frozenset()


@dataclass
class MatchmakingSettings:
    """What the rule is given of a worker's swarm settings (``SwarmSettings.matchmaking_settings``), and how
    often the loops that carry it out look."""

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


@dataclass(frozen=True)
class Peer:
    """A live worker's record, as the rule reads it."""

    outer_step: int
    heading: int
    ready_at: float | None = None
    """When it says it will be ready for its next round, on this worker's clock (None: it published none)."""
    time: float = 0.0
    """When it wrote the record, on its own clock (compared with its announcement's ``since``)."""


@dataclass(frozen=True)
class Announcement:
    """A peer's announcement that it is ready for a round."""

    attempt: int
    numel: object = None
    codec: object = None
    part: object = None
    config: object = ""
    since: float | None = None
    """When it began matchmaking, on its own clock (compared with its record's ``time``)."""
    since_here: float | None = None
    """The same, on this worker's clock (None: not a number)."""
    avoid: frozenset[str] = NONE
    """The peers it caught sending malformed data."""
    unreachable: frozenset[str] = NONE
    """The peers it could not dial."""
    broke: frozenset[str] = NONE
    """The peers that broke an attempt of its."""
    relayed: bool = False
    """Whether it is reached only through relays (it owns an empty shard)."""

    @classmethod
    def of(cls, value: Mapping, since_here: float | None = None) -> Announcement:
        """From an announcement's value (checked: ``attempt`` is an int); ``since_here``: its ``since`` on this
        worker's clock."""
        since = value.get("since")
        return cls(attempt=value["attempt"], numel=value.get("numel"), codec=value.get("codec"),
                   part=value.get("part"), config=value.get("config", ""),
                   since=since if isinstance(since, (int, float)) else None, since_here=since_here,
                   avoid=announced_avoid(value), unreachable=announced_avoid(value, "unreachable"),
                   broke=announced_avoid(value, "broke"), relayed=value.get("relayed") is True)


@dataclass(frozen=True)
class Closing:
    """What a worker closing the group has seen so far (it gathered, and nobody is waited for any more)."""

    compatible: frozenset[str]
    """The peers that announced this attempt with our settings and have not applied the round."""
    gone: frozenset[str]
    """Those of them that left the round (``gone``): neither leaders nor members."""
    published_ours: bool = False
    """Whether this worker has published its group already (it leads: it reads it back)."""
    read_in: bool = True
    """Whether a read of the attempt's groups under way is in (or waited for long enough)."""
    overdue: bool = False
    """Whether the group took longer than ``straggler_wait + matchmaking_timeout`` to come."""


@dataclass(frozen=True)
class MatchView:
    """Everything the rule looks at, as plain data; times on this worker's clock (offsets applied)."""

    me: str
    key: RoundKey
    attempt: int
    numel: int
    codec: str
    now: float
    began: float
    """When this worker began matchmaking for the round."""
    workers: Mapping[str, Peer]
    """The run's live workers (this one's own record may be among them)."""
    announcements: Mapping[str, Announcement]
    """The round's announcements, this worker's own as it announced it."""
    trust: Trust
    """Whose word counts (``partners.py``): whose ready times are believed, who votes the run past us."""
    taken: frozenset[str] = NONE
    """Peers in groups of this attempt that leave this worker out."""
    suspects: frozenset[str] = NONE
    """Peers that broke an earlier attempt: not waited for, but may join."""
    frozen: frozenset[str] = NONE
    """Peers found frozen: neither waited for nor grouped with."""
    joiners: frozenset[str] = NONE
    """Peers that just downloaded this worker's state of this outer step: on their way to its round."""
    last_group: frozenset[str] = NONE
    """The members of this worker's last completed round."""
    no_shows: frozenset[str] = NONE
    """Peers that promised a ready time and did not come: not believed until they take part again."""
    behind_nat: bool = False
    """Whether this worker is reached only through relays."""
    published: Mapping[str, object] | None = None
    """The groups published for this attempt, by publisher, as read at this look (None: not looked at)."""
    closing: Closing | None = None
    """Set once this worker closes the group; None while it gathers."""
    fresh: bool = False
    """While closing: the workers and announcements were just read again."""

    @property
    def outer_step(self) -> int:
        return self.key.outer_step


@dataclass(frozen=True)
class Notes:
    """What the loop records or asks, whatever the outcome."""

    probe: frozenset[str] = NONE
    """Peers to ping: those waited for, and the frozen heading here (are they back?)."""
    controls: tuple[str, ...] = ()
    """Ready peers that answer pings (a ping unanswered counts only while another echoes)."""
    no_shows: frozenset[str] = NONE
    """Peers that promised a ready time and were given up on: their next promise is not believed."""
    refused_by: tuple[str, ...] = ()
    """Members whose announcements name this worker for malformed data, when they keep it out."""
    taken: frozenset[str] | None = None
    """The peers grouped without this worker, where published groups were looked at."""


@dataclass(frozen=True)
class Wait:
    """Nothing to do yet: look again (at ``until``, the moment the last awaited peer is given up on, at most)."""

    why: str
    until: float | None = None
    closing: Closing | None = None
    """While closing: what it has seen, as updated at this look."""
    notes: Notes = field(default_factory=Notes)


@dataclass(frozen=True)
class Close:
    """Nobody is waited for any more: close the group of the peers that announced the attempt."""

    closing: Closing
    members: frozenset[str]
    """The group as this worker sees it now (those left out of it are logged, with why)."""
    missing: frozenset[str]
    """Those waited for until ``until``, who did not come."""
    until: float
    alone: bool
    """A group of one: the loop checks this worker is not cut off from the run before it goes on."""
    notes: Notes = field(default_factory=Notes)


@dataclass(frozen=True)
class Group:
    """The members of the round: publish them (this worker leads), or adopt the leader's group."""

    members: tuple[str, ...]
    relayed: frozenset[str]
    publish: bool
    notes: Notes = field(default_factory=Notes)
    closing: Closing | None = None
    """For a group to publish: the closing state it was decided on (who announced, who left), to read it back."""


@dataclass(frozen=True)
class Follow:
    """The peer that would publish this attempt's group announced a later attempt: go there."""

    leader: str
    attempt: int
    notes: Notes = field(default_factory=Notes)


@dataclass(frozen=True)
class Fail:
    """The attempt fails: ``behind`` (a ``BehindError``: catch up to the run) or not (an ``AveragingError``)."""

    message: str
    behind: bool = False
    left_out: frozenset[str] | None = None
    """Behind because these members went on in a group without this worker."""
    forget_unreachable: tuple[str, ...] = ()
    """Peers this worker named unreachable that left it alone: its names of them lapse now."""
    notes: Notes = field(default_factory=Notes)


Outcome = Wait | Close | Group | Follow | Fail


def in_round(peer, outer_step: int) -> bool:
    """Whether a peer's record says its round ``outer_step`` is in flight: it has started that round (a
    streamed round runs in the background) and heads for the next. Its announcement of the round may
    not have reached the DHT yet, but it is in the round: it is waited for, for ``straggler_wait`` (its
    published ready time is for the round after), and not held to that time if it does not come."""
    return peer.outer_step == outer_step and peer.heading == outer_step + 1


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
    kept = {p: refusals.get(p, NONE) for p in candidates}
    big_enough = max(2, min_group_size)
    with_unreachable = {p: kept[p] | unreachables.get(p, NONE) for p in candidates}
    if max(map(len, partition(candidates, with_unreachable)), default=0) >= big_enough:
        kept = with_unreachable
    with_broken = {p: kept[p] | broken.get(p, NONE) for p in candidates}
    largest = max(map(len, partition(candidates, with_broken)), default=0)
    if largest >= big_enough and 2 * largest > len(candidates):
        kept = with_broken
    return kept


def wait_until(ready_at: float | None, began: float, straggler_wait: float, max_wait: float,
               vouched: bool = True) -> float:
    """Until when a live peer that is not ready yet is waited for.

    Its own published ready time (``ready_at``, on this worker's clock) plus ``straggler_wait`` of grace (a 4x
    slower peer says it comes 4x later, and is waited for); ``straggler_wait`` from the start of matchmaking
    for a peer that published none (``None``: also a peer that did not come when it promised, or whose round
    is in flight); never more than ``max_wait``. A peer whose word does not count here (``vouched`` False:
    ``partners.py``) is believed for one ``straggler_wait`` at most, so however many identities a no-show
    uses, a round waits for the unvouched ones ``2 * straggler_wait`` at most. A dead peer stops being waited
    for when its record expires, a hung one when its ready time has passed."""
    expected = began if ready_at is None else ready_at
    if not vouched:  # believed for one grace at most: an honest newcomer that joined through another member
        expected = min(expected, began + straggler_wait)
    return min(max(expected, began) + straggler_wait, began + max_wait)


def next_attempt(announcements: Mapping[str, Announcement], live: Iterable[str], attempt: int,
                 max_jump: int) -> int:
    """The attempt to announce: the latest that a live worker of the run announced, at most ``max_jump`` ahead
    (no peer can push the run to attempt 10**9 and out of its retries)."""
    live = set(live)
    return max([attempt] + [a.attempt for p, a in announcements.items()
                            if p in live and a.attempt <= attempt + max_jump])


def compatible(view: MatchView, settings: MatchmakingSettings) -> set[str]:
    """The peers that announced this attempt with this worker's settings."""
    return {p for p, a in view.announcements.items() if a.attempt == view.attempt and a.numel == view.numel
            and a.codec == view.codec and a.part == settings.part_numel and a.config == settings.config}


def moved_on(workers: Mapping[str, Peer], outer_step: int, me: str) -> set[str]:
    """Peers that have applied this round already (their announcement of it may still be read)."""
    return {p for p, r in workers.items() if r.outer_step > outer_step} - {me}


def gone(workers: Mapping[str, Peer], announcements: Mapping[str, Announcement | None], outer_step: int,
         me: str) -> set[str]:
    """Peers that announced this round and are no longer in it: their record is gone (dead, or left), or was
    written after their announcement and says they head for an earlier round (they went back, to catch up or
    heal drift). Neither leads a group nor is waited for as if ready; a record older than the announcement
    says nothing yet."""
    out = set()
    for p, a in announcements.items():
        rec = workers.get(p)
        since = a.since if a is not None else None
        if p != me and (rec is None or (rec.heading < outer_step and since is not None and rec.time > since)):
            out.add(p)
    return out


def avoids_of(view: MatchView, candidates: set[str], settings: MatchmakingSettings) -> dict[str, frozenset[str]]:
    """What the candidates' announcements keep apart (``guarded_avoids``)."""
    named = {p: view.announcements[p] for p in candidates if p in view.announcements}
    return guarded_avoids(candidates, {p: a.avoid for p, a in named.items()},
                          {p: a.unreachable for p, a in named.items()}, {p: a.broke for p, a in named.items()},
                          settings.min_group_size)


def shared_start(view: MatchView, peers: Iterable[str], settings: MatchmakingSettings) -> float:
    """The earliest plausible ``since`` among the announcements of ``peers`` (ours if none is): everyone measures
    from it, so that the leader and the members give up on a straggler at the same moment."""
    oldest = view.now - settings.max_wait - settings.matchmaking_timeout
    times = [view.announcements[p].since_here for p in peers]
    return min([view.began] + [t for t in times if t is not None and oldest <= t <= view.now])


def published_group(view: MatchView, announced: set[str], avoids: Mapping[str, frozenset[str]]
                    ) -> tuple[tuple[str, ...] | None, frozenset[str], bool]:
    """The group published for this attempt that holds this worker (or None), the peers grouped without it,
    and whether those leave it behind.

    A group counts if its publisher leads it (the smallest member id), its members are distinct, every one of
    them announced this attempt with our settings (``announced``), none of them avoids another, and some of
    them are alive; of several holding us, the smallest publisher's wins. Groups that leave this worker out
    are other workers' business (nobody waits for their members here), unless together they are at least
    half the run's live workers whose word counts here: then the run moves on without us (catch up to it)."""
    live = set(view.workers) | {view.me}
    groups = {p: tuple(sorted(set(m))) for p, m in (view.published or {}).items()
              if isinstance(m, list) and m and all(isinstance(x, str) for x in m) and len(set(m)) == len(m)
              and p == min(m) and live & set(m) and set(m) <= announced and not conflicts(m, avoids)}
    holding_me = {p: m for p, m in groups.items() if view.me in m}
    if holding_me:
        return holding_me[min(holding_me)], view.taken, False
    taken = frozenset().union(*groups.values()) if groups else NONE
    voters = view.trust.vouched(live | taken)  # fresh identities do not count
    return None, taken, bool(taken & voters) and 2 * len(taken & voters) >= len(voters)


def decide(view: MatchView, settings: MatchmakingSettings) -> Outcome:
    """What to do now, for this round key and attempt: the whole matchmaking rule (see the module's docstring)."""
    return _close(view, settings) if view.closing is not None else _gather(view, settings)


def _gather(view: MatchView, settings: MatchmakingSettings) -> Outcome:
    s, me, step, workers = settings, view.me, view.outer_step, view.workers
    announced_ok = compatible(view, s) - moved_on(workers, step, me)
    avoids = avoids_of(view, announced_ok | {me}, s)
    frozen = view.frozen
    ready = announced_ok - (view.taken - {me}) - gone(workers, view.announcements, step, me) - frozen
    mine = part_of(me, ready, avoids)  # without peers that members of it avoid
    refusing = tuple(sorted(p for p in ready if me in view.announcements[p].avoid))
    notes = Notes(refused_by=refusing if me not in conflict_free(ready, avoids) else ())
    # Peers heading for this round: at its outer step, or one behind with a streamed round still in flight that
    # they will apply before they come; members of this worker's last round whose record has not caught up with
    # it yet (it says they are one step behind, still heading there: their ready time is stale too); peers
    # that just downloaded our state of this step, whatever their record says yet.
    in_flight = {p for p, r in workers.items() if in_round(r, step)}
    in_flight |= {p for p in view.last_group - {me} if p in workers and workers[p].outer_step == step - 1
                  and workers[p].heading < step}
    heading = {p for p, r in workers.items() if r.heading == step} | in_flight
    heading |= {p for p in view.joiners if p not in workers or workers[p].heading < step}
    expected = (heading - view.suspects - view.taken - frozen) | {me}
    # A peer that would be left out of our group even if it came now is not waited for.
    missing = {p for p in expected - ready if p in part_of(me, ready | {p}, avoids)}
    notes = replace(notes, probe=frozenset(p for p in missing | (frozen & heading) if p in workers),
                    controls=tuple(p for p in sorted(ready - {me}) if not view.announcements[p].relayed))
    enough = len(mine) >= s.min_group_size
    shared = shared_start(view, ready, s)
    # A ready time is believed in full only from a peer whose word counts here; from any other peer, a joiner
    # that has just downloaded our state included, for one grace at most (``partners.py``).
    believable = view.trust.vouched(set(workers) | {me}) & missing
    give_up_at = max((wait_until(_promise(view, p, in_flight), shared, s.straggler_wait, s.max_wait,
                                 p in believable) for p in missing), default=shared)
    if enough and view.now >= give_up_at:
        # It promised a time and is not here: its next promise is not believed.
        notes = replace(notes, no_shows=frozenset(p for p in missing - in_flight
                                                  if p in workers and workers[p].ready_at is not None))
        others = set(workers) - {me}
        if mine == {me} and others:
            return _alone(view, ready, refusing, others, notes)
        closing = Closing(frozenset(announced_ok), frozenset(announced_ok - set(workers) - {me}))
        return Close(closing, frozenset(mine), frozenset(missing), give_up_at, mine == {me}, notes)
    if not enough and view.now >= max(shared + s.matchmaking_timeout, give_up_at):
        return Fail(f"matchmaking for round {view.key}: {len(ready)} peer(s) ready after "
                    f"{view.now - shared:.0f}s, need {s.min_group_size}", notes=notes)
    if view.published is not None:  # a leader may have closed the group already (it gave up on a straggler)
        return _published(view, announced_ok, avoids, notes, Wait("peers are awaited", give_up_at, notes=notes))
    return Wait("peers are awaited", give_up_at, notes=notes)


def _promise(view: MatchView, peer: str, in_flight: set[str]) -> float | None:
    """The ready time of ``peer`` believed here: none from a no-show, nor from a peer with the round in flight
    (its ready time is for the round after: it gets the grace only)."""
    record = view.workers.get(peer)
    if record is None or peer in in_flight or peer in view.no_shows:
        return None
    return record.ready_at


def _alone(view: MatchView, ready: set[str], refusing: tuple[str, ...], others: set[str], notes: Notes) -> Fail:
    """Alone while the run has other live workers: a round of one would fork θ_global from theirs. If they are
    all past this round, this worker is the one behind; else (joining, catching up, behind a slow link) the
    work is kept and goes into the next round (under pace "swarm"), with whoever is there then."""
    key, me = view.key, view.me
    if refusing:
        return Fail(f"round {key}: left out of the group: {len(refusing)} member(s) refuse to average with this "
                    f"worker, naming it for malformed data ({', '.join(p[-8:] for p in refusing)}); "
                    "not applied alone", notes=notes)
    if all(view.workers[p].heading > view.outer_step for p in others):
        return Fail(f"alone in round {key}: every other worker is past it", behind=True, notes=notes)
    mine = view.announcements[me].unreachable if me in view.announcements else NONE
    apart = tuple(sorted(p for p in ready - {me} if me in view.announcements[p].unreachable or p in mine))
    if apart:  # its own names lapse now: left alone by them, it tries those peers again next time
        return Fail(f"round {key}: left out of the group: this worker and {len(apart)} member(s) could not "
                    f"dial each other ({', '.join(p[-8:] for p in apart)}); not applied alone",
                    forget_unreachable=apart, notes=notes)
    return Fail(f"round {key}: no other worker was ready in time ({len(others)} other live worker(s) in the run); "
                "not applied alone", notes=notes)


def _published(view: MatchView, announced: set[str], avoids, notes: Notes, otherwise: Outcome) -> Outcome:
    members, taken, behind = published_group(view, announced, avoids)
    notes = replace(notes, taken=taken)
    if members is not None:
        return Group(members, _relayed(view, members), publish=False, notes=notes)
    if behind:
        return Fail(f"left out of the group for round {view.key}", behind=True, left_out=taken, notes=notes)
    return replace(otherwise, notes=notes)


def _close(view: MatchView, settings: MatchmakingSettings) -> Outcome:
    """Closing: publish the group (this worker leads: the smallest id of those ready and not taken), or wait
    for the leader's."""
    s, me, closing = settings, view.me, view.closing
    if view.fresh:  # who announced, who moved on, who left the round
        known = (closing.compatible | compatible(view, s)) - moved_on(view.workers, view.outer_step, me)
        closing = replace(closing, compatible=frozenset(known), gone=frozenset(
            gone(view.workers, {p: view.announcements.get(p) for p in known}, view.outer_step, me)))
    avoids = avoids_of(view, closing.compatible | {me}, s)
    notes, taken = Notes(), view.taken
    if view.published is not None:  # a group already closed for this round wins over our own view
        outcome = _published(view, closing.compatible, avoids, notes, Wait("closing", closing=closing))
        if not isinstance(outcome, Wait):
            return outcome
        notes, taken = outcome.notes, outcome.notes.taken
    # A peer found frozen is not grouped with here either: it announced before it froze, and a group that
    # holds it fails its exchange (the gathering step already left it out of this worker's part).
    candidates = part_of(me, closing.compatible - (taken - {me}) - closing.gone - view.frozen, avoids)
    key = view.key
    if len(candidates) < s.min_group_size:
        return Fail(f"round {key}: {len(candidates)} peer(s) left for a group, need {s.min_group_size}", notes=notes)
    if candidates == {me} and closing.compatible - {me}:
        # It came here with others ready, and they are gone, grouped without it, or moved on. Whether it may
        # average alone is for the next attempt to decide (a round of one while other workers live, or while
        # cut off from the run, would fork θ_global).
        return Fail(f"round {key}: the {len(closing.compatible - {me})} other peer(s) ready for the round left it "
                    "or were grouped without this worker before its group closed; not applied alone", notes=notes)
    if not closing.published_ours and min(candidates) == me and closing.read_in:
        members = tuple(sorted(candidates))
        return Group(members, _relayed(view, members), publish=True, notes=notes, closing=closing)
    if closing.overdue:
        return Fail(f"no group was published for round {key}", notes=notes)
    # The candidate that would publish this attempt's group announced a later attempt: it took another
    # leader's group of this attempt, or failed one, and publishes none here (where leaders disagree on who
    # is ready, its members waited for a group that never came until the run moved on without them).
    leader = min(candidates)
    later = view.announcements[leader].attempt if leader in view.announcements else view.attempt
    if leader != me and view.attempt < later <= view.attempt + s.max_attempt_jump:
        return Follow(leader, later, notes=notes)
    return Wait(f"the group of {leader[-8:]} is awaited", closing=closing, notes=notes)


def _relayed(view: MatchView, members: Iterable[str]) -> frozenset[str]:
    """The members reached only through relays (their announcements say so; this worker knows it of itself)."""
    return frozenset(m for m in members if (view.behind_nat if m == view.me else
                                            m in view.announcements and view.announcements[m].relayed))


