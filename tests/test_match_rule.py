"""The matchmaking rule as a table: ``match_rule.decide`` on plain views, one row per rule of the docs
(docs/pacing.md's waits, docs/trust.md's exclusion and whose word counts) and per case a past bug came from.

Every row is worker "a" (or ``me``) in round 5.0, attempt 0, at DHT time 1000 unless the row says otherwise;
peers given as a string are live at outer step 5, heading for it, without a ready time; announcements given as
a string are of attempt 0 with this worker's settings, made at 1000. ``straggler_wait`` is 10, ``max_wait``
600, ``matchmaking_timeout`` 30, ``min_group_size`` 2 unless the row says ``min``."""

from __future__ import annotations

import dataclasses

import pytest

from opendiloco.comm.base import RoundKey
from opendiloco.swarm.match_rule import (
    Announcement,
    Close,
    Closing,
    Fail,
    Follow,
    Group,
    MatchmakingSettings,
    MatchView,
    Peer,
    Wait,
    decide,
    next_attempt,
)
from opendiloco.swarm.partners import Trust

NOW = 1000.0
SETTINGS = MatchmakingSettings(run_id="r", min_group_size=2, matchmaking_timeout=30.0, straggler_wait=10.0,
                               max_wait=600.0)


def peer(outer_step: int = 5, heading: int | None = None, ready_at: float | None = None, time: float = NOW) -> Peer:
    return Peer(outer_step, outer_step if heading is None else heading, ready_at, time)


def ann(attempt: int = 0, since: float = NOW, **names) -> Announcement:
    fields = {k: frozenset(v) if k in ("avoid", "unreachable", "broke") else v for k, v in names.items()}
    defaults = dict(numel=10, codec="fp16", part=SETTINGS.part_numel, config="")
    return Announcement(attempt, since=since, since_here=since, **{**defaults, **fields})


def view(me: str = "a", workers="abc", announced="abc", partners=None, **more) -> MatchView:
    """``partners``: this worker's partners (None: it never had one, so every peer's word counts)."""
    workers = {p: peer() for p in workers} if isinstance(workers, str) else workers
    announced = {p: ann() for p in announced} if isinstance(announced, str) else announced
    for k in ("taken", "suspects", "frozen", "joiners", "last_group", "no_shows"):
        if k in more:
            more[k] = frozenset(more[k])
    trust = Trust(me, frozenset(partners or ()), alone=False)
    return MatchView(**{**dict(me=me, key=RoundKey(5), attempt=0, numel=10, codec="fp16", now=NOW, began=NOW,
                               workers=workers, announcements=announced, trust=trust), **more})


def closing(compatible="abc", gone="", **more) -> Closing:
    return Closing(frozenset(compatible), frozenset(gone), **more)


def seen(outcome) -> tuple:
    """An outcome as a row's expectation: its kind and the one detail that matters."""
    if isinstance(outcome, Wait):
        return ("wait",)
    if isinstance(outcome, Close):
        return ("close", "".join(sorted(outcome.members)))
    if isinstance(outcome, Group):
        return ("publish" if outcome.publish else "adopt", "".join(outcome.members))
    if isinstance(outcome, Follow):
        return ("follow", outcome.attempt)
    assert isinstance(outcome, Fail)
    return ("behind" if outcome.behind else "fail", outcome.message)


R = pytest.param
ROWS = [
    # -- gathering: who is waited for, and until when (docs/pacing.md) ------------------------------------
    R(view(), {}, ("close", "abc"), id="everyone ready: the group closes"),
    R(view(announced="ab"), {}, ("wait",), id="a live peer heading here that has not announced is waited for"),
    R(view(announced="ab", now=1010.0), {}, ("close", "ab"),
      id="one without a ready time is waited for straggler_wait from the start"),
    R(view(workers=dict(a=peer(), b=peer(), c=peer(ready_at=1100.0)), announced="ab", now=1105.0), {}, ("wait",),
      id="a slow peer is waited for until its own ready time plus grace"),
    R(view(workers=dict(a=peer(), b=peer(), c=peer(ready_at=1100.0)), announced="ab", now=1110.0),
      dict(no_shows={"c"}), ("close", "ab"), id="then given up on, and noted a no-show"),
    R(view(workers=dict(a=peer(), b=peer(), c=peer(ready_at=1100.0)), announced="ab", now=1010.0, no_shows="c"),
      {}, ("close", "ab"), id="a no-show's next promise is not believed"),
    R(view(workers=dict(a=peer(), b=peer(), c=peer(ready_at=1e9)), announced="ab", now=1600.0), {},
      ("close", "ab"), id="no peer is waited for longer than max_wait"),
    R(view(announced=dict(a=ann(), b=ann(since=990.0))), {}, ("close", "ab"),
      id="everyone measures from the earliest announcement"),
    R(view(announced=dict(a=ann(), b=ann(since=100.0))), {}, ("wait",),
      id="an implausibly old announcement start is not believed"),
    R(view(workers=dict(a=peer(), b=peer(), c=peer(ready_at=1100.0)), announced="ab", partners="b", now=1020.0),
      {}, ("close", "ab"), id="an unvouched ready time is believed one grace at most"),
    R(view(workers=dict(a=peer(), b=peer(), c=peer(ready_at=1100.0)), announced="ab", partners="bc", now=1020.0),
      {}, ("wait",), id="a partner's ready time is believed in full"),
    R(view(workers=dict(a=peer(), b=peer(), c=peer(heading=6, ready_at=1100.0)), announced="ab", now=1005.0), {},
      ("wait",), id="a peer with the round in flight is waited for before its announcement comes"),
    R(view(workers=dict(a=peer(), b=peer(), c=peer(heading=6, ready_at=1100.0)), announced="ab", now=1010.0),
      dict(no_shows=set()), ("close", "ab"),
      id="a peer with the round in flight is waited for one grace only, and is no no-show"),
    R(view(workers=dict(a=peer(), b=peer(), c=peer(4)), announced="ab", last_group="c"), {}, ("wait",),
      id="a member of the last round whose record lags is waited for"),
    R(view(workers=dict(a=peer(), b=peer(), c=peer(4)), announced="ab"), {}, ("close", "ab"),
      id="a peer one step behind, not in flight, is not waited for"),
    R(view(workers="ab", announced="ab", joiners="c"), {}, ("wait",),
      id="a joiner that took our state is waited for before its record is read"),
    R(view(announced="ab", suspects="c"), {}, ("close", "ab"), id="a suspect is not waited for"),
    R(view(frozen="c"), dict(probe={"c"}), ("close", "ab"),
      id="a frozen peer is neither waited for nor grouped with, but pinged again"),
    R(view(announced="ab"), dict(probe={"c"}, controls=("b",)), ("wait",),
      id="a peer waited for is pinged, with a ready one to compare"),
    R(view(announced="ab", taken="c"), {}, ("close", "ab"), id="a peer grouped without us is not waited for"),
    R(view(workers=dict(a=peer(), b=peer(), c=peer(6))), {}, ("close", "ab"),
      id="a peer that already applied the round is not grouped with"),
    R(view(workers=dict(a=peer(), b=peer(), c=peer(4, time=NOW + 1))), {}, ("close", "ab"),
      id="a peer that went back after announcing is gone"),
    R(view(workers=dict(a=peer(), b=peer(), c=peer(4, time=NOW - 1))), {}, ("close", "abc"),
      id="a record older than the announcement says nothing yet"),
    R(view(workers="ab"), {}, ("close", "ab"), id="a dead announcer is not grouped with"),
    R(view(announced=dict(a=ann(), b=ann(), c=ann(codec="int8")), now=1010.0), {}, ("close", "ab"),
      id="an announcement with other settings does not count"),
    R(view(announced=dict(a=ann(), b=ann(), c=ann(attempt=1)), now=1010.0), {}, ("close", "ab"),
      id="an announcement of another attempt does not count"),
    # -- group size ----------------------------------------------------------------------------------
    R(view(workers="ab", announced="ab"), dict(min=3), ("wait",), id="too few: wait for min_group_size"),
    R(view(workers="ab", announced="ab", now=1030.0), dict(min=3), ("fail", "2 peer(s) ready after 30s, need 3"),
      id="too few after matchmaking_timeout: fail, naming min_group_size"),
    # -- never a round of one while the run has other live workers ------------------------------------
    R(view(workers="ab", announced="a", now=1010.0), dict(min=1),
      ("fail", "no other worker was ready in time (1 other live worker(s) in the run); not applied alone"),
      id="alone while others live: not applied alone"),
    R(view(workers=dict(a=peer(), b=peer(6)), announced="a"), dict(min=1),
      ("behind", "every other worker is past it"), id="alone while every other worker is past the round: behind"),
    R(view(workers="ab", announced=dict(a=ann(), b=ann(avoid="a"))), dict(min=1, refused_by=("b",)),
      ("fail", "1 member(s) refuse to average with this worker"), id="alone because members refuse it: told why"),
    R(view(announced=dict(a=ann(), b=ann(unreachable="a"), c=ann(unreachable="a"))),
      dict(min=1, forget=("b", "c")), ("fail", "could not dial each other"),
      id="alone, apart from peers it could not dial: its own names lapse"),
    R(view(workers="a", announced="a"), dict(min=1, alone=True), ("close", "a"),
      id="a run of one closes alone, once the loop checked it is not cut off"),
    # -- what announcements keep apart (docs/trust.md) --------------------------------------------------
    R(view(workers="abcx", announced=dict(a=ann(), b=ann(avoid="x"), c=ann(avoid="x"), x=ann())), {},
      ("close", "abc"), id="a peer named for malformed data is left out"),
    R(view(announced=dict(a=ann(avoid="c"), b=ann()), workers="abc"), {}, ("close", "ab"),
      id="a peer that would be left out even if it came is not waited for"),
    R(view(workers="abcx", announced=dict(a=ann(broke="x"), b=ann(broke="x"), c=ann(broke="x"), x=ann())), {},
      ("close", "abc"), id="an insider named a breaker by the others is left out"),
    R(view(workers="abcd", announced=dict(a=ann(), b=ann(), c=ann(broke="ab"), d=ann(broke="ab"))), {},
      ("close", "abcd"), id="broke names followed only by a majority"),
    R(view(workers="ab", announced=dict(a=ann(), b=ann(unreachable="a"))), {}, ("close", "ab"),
      id="unreachable names that would bind forever are ignored"),
    R(view(announced=dict(a=ann(), b=ann(unreachable="c"), c=ann())), dict(min=3), ("close", "abc"),
      id="unreachable names that leave no group of min_group_size are ignored"),
    R(view(announced=dict(a=ann(), b=ann(unreachable="c"), c=ann())), {}, ("close", "ab"),
      id="unreachable names that leave a group big enough count"),
    # -- published groups, seen while gathering ---------------------------------------------------------
    R(view(me="b", workers="abcd", published={"a": ["a", "b"]}), {}, ("adopt", "ab"),
      id="the leader's group holding this worker is adopted"),
    R(view(me="c", workers="abcd", published={"b": ["a", "b", "c"]}), {}, ("wait",),
      id="a group whose publisher is not its smallest member is ignored"),
    R(view(me="b", workers="abcd", announced=dict(a=ann(), b=ann(), c=ann(avoid="a")),
           published={"a": ["a", "b", "c"]}), {}, ("wait",), id="a group holding a peer a member avoids is ignored"),
    R(view(me="b", workers="abcd", announced="ab", published={"a": ["a", "b", "c"]}), {}, ("wait",),
      id="a group with a member that did not announce is ignored"),
    R(view(me="c", workers="abcd", published={"a": ["a", "c"], "b": ["b", "c"]}), {}, ("adopt", "ac"),
      id="of several groups holding this worker, the smallest publisher's"),
    R(view(me="c", workers="abcde", published={"a": ["a", "b"]}), dict(taken={"a", "b"}), ("wait",),
      id="a group without this worker: its members are not waited for"),
    R(view(me="c", workers="abcd", published={"a": ["a", "b"]}), dict(left_out={"a", "b"}),
      ("behind", "left out of the group for round 5.0"), id="a group without this worker of half the run: behind"),
    R(view(me="c", workers="abcd", partners="d", published={"a": ["a", "b"]}), {}, ("wait",),
      id="fresh identities' group does not leave a partner behind"),
    # -- closing: the leader publishes, members adopt or follow ---------------------------------------
    R(view(closing=closing()), {}, ("publish", "abc"), id="the smallest candidate publishes"),
    R(view(me="b", closing=closing()), {}, ("wait",), id="a member waits for the leader's group"),
    R(view(frozen="c", closing=closing()), {}, ("publish", "ab"),
      id="the leader leaves a peer found frozen after it announced out of the group it publishes"),
    R(view(me="b", frozen="a", closing=closing()), {}, ("publish", "bc"),
      id="a member that finds the smallest frozen leads in its place"),
    R(view(closing=closing(read_in=False)), {}, ("wait",), id="the leader waits for a read of groups under way"),
    R(view(closing=closing(published_ours=True), published={"a": ["a", "b", "c"]}), {}, ("adopt", "abc"),
      id="the leader adopts its group once read back"),
    R(view(me="b", closing=closing(gone="a")), {}, ("publish", "bc"),
      id="a leader that left the round is not waited for"),
    R(view(me="b", closing=closing(), announced=dict(a=ann(attempt=2), b=ann(), c=ann())), {}, ("follow", 2),
      id="the leader that went on to a later attempt is followed"),
    R(view(me="b", closing=closing(), announced=dict(a=ann(attempt=20), b=ann(), c=ann())), {}, ("wait",),
      id="a leader too far ahead is not followed"),
    R(view(me="b", closing=closing(gone="a"), published={"a": ["a", "b"]}), {}, ("adopt", "ab"),
      id="a group already closed wins over our own view"),
    R(view(me="b", workers="ab", closing=closing("ab", gone="a")), dict(min=1),
      ("fail", "left it or were grouped without this worker before its group closed; not applied alone"),
      id="its peers all left before the group closed: not applied alone"),
    R(view(closing=closing(), taken="c"), dict(min=3), ("fail", "2 peer(s) left for a group, need 3"),
      id="too few candidates left"),
    R(view(me="b", closing=closing(overdue=True)), {}, ("fail", "no group was published for round 5.0"),
      id="no group published in time"),
    R(view(workers=dict(a=peer(), b=peer(), c=peer(4, time=NOW + 1)), closing=closing(), fresh=True), {},
      ("publish", "ab"), id="a fresh read drops a peer that went back"),
]


@pytest.mark.parametrize("match,expect,outcome", ROWS)
def test_the_matchmaking_rule(match: MatchView, expect: dict, outcome: tuple):
    settings = dataclasses.replace(SETTINGS, min_group_size=expect.get("min", SETTINGS.min_group_size))
    out = decide(match, settings)
    got = seen(out)
    if got[0] in ("fail", "behind"):  # the message holds the row's words
        assert got[0] == outcome[0] and outcome[1] in got[1], (got, outcome)
    else:
        assert got == outcome
    if "no_shows" in expect:
        assert out.notes.no_shows == expect["no_shows"]
    if "probe" in expect:
        assert out.notes.probe == expect["probe"]
    if "controls" in expect:
        assert out.notes.controls == expect["controls"]
    if "refused_by" in expect:
        assert out.notes.refused_by == expect["refused_by"]
    if "taken" in expect:
        assert out.notes.taken == expect["taken"]
    if "forget" in expect:
        assert out.forget_unreachable == expect["forget"]
    if "left_out" in expect:
        assert out.left_out == expect["left_out"]
    if "alone" in expect:
        assert out.alone is expect["alone"]


@pytest.mark.parametrize("announced,live,expected", [
    (dict(b=3), "ab", 3),
    (dict(b=9), "ab", 0),     # more than max_attempt_jump (8) ahead: nobody pushes a round past its retries
    (dict(x=3), "ab", 0),     # only a live worker's attempt counts
    (dict(b=3, c=5), "abc", 5),
], ids=["a live worker's later attempt", "too far ahead", "not live", "the latest"])
def test_the_attempt_announced(announced, live, expected):
    assert next_attempt({p: ann(a) for p, a in announced.items()}, set(live), 0, 8) == expected


def test_a_leader_publishing_on_a_fresh_read_keeps_what_that_read_learned():
    """The leader's group is read back against the peers that announced: one that announced since the closing
    step began is in the group it publishes, and in the closing state it reads the group back with (the loop
    once kept its older state, and did not recognise its own group until the next fresh read)."""
    out = decide(view(closing=closing(compatible="ab"), fresh=True), SETTINGS)
    assert isinstance(out, Group) and out.publish and out.members == ("a", "b", "c")
    assert out.closing is not None and out.closing.compatible == {"a", "b", "c"}
