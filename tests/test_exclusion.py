"""A member that breaks rounds is dropped from them (issue #25, item 5), without processes.

Who is blamed: the runner names a member only for bytes its own checks refused (``Malformed``), never
a member that refused or closed its streams because someone else broke the round. What is remembered
(``Offenders``, bounded), and how the refusals members announce shape a group (``conflict_free``): the
same on every member, out at once when one honest member caught it, and a liar keeps out one honest
member at most. Then the matchmaker itself, over an in-memory record table: members agree on the
group without the offender, and the offender is told why.
"""

from __future__ import annotations

import itertools
import logging
import threading

import pytest
import torch

from opendiloco.comm.base import RoundKey
from opendiloco.comm.runner import RoundRunner
from opendiloco.errors import AveragingError, BehindError, Malformed, PeerFailure
from opendiloco.swarm.exclusion import (
    EXCLUDE_ROUNDS,
    MAX_AVOID,
    Offenders,
    announced_avoid,
    conflict_free,
    conflicts,
    part_of,
    partition,
)
from opendiloco.swarm.matchmaking import Matchmaker
from opendiloco.swarm.records import WorkerRecord
from tests.test_matchmaking_gone import SETTINGS, Presence, Table, Writer
from tests.test_runner import PART, _contribute_honestly, _owner_answer, attack, honest_round, run

pytestmark = pytest.mark.timeout(60)


# -- who is blamed: only what this worker checked itself ----------------------------------------------

class BreakingRunner(RoundRunner):
    """Its first part of the first other member's shard is malformed (as tests/swarm/attack_malformed.py)."""

    mode = "nan"

    def _encode(self, a, b):
        payload = super()._encode(a, b)
        target = next(j for j in range(len(self.members)) if j != self.my_index)
        if a != self.bounds[target][0]:
            return payload
        if self.mode == "short":
            return bytes(payload)[:-2]
        return torch.full((b - a,), float("nan"), dtype=torch.float16).view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("mode", ["nan", "short"])
def test_only_the_member_that_checked_the_malformed_part_names_its_sender(mode, monkeypatch):
    members = ("a", "b", "c", "d")
    flats = [torch.randn(8 * PART, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    runners = {}
    original = RoundRunner.__init__

    def make(self, group, me, *args, **kw):  # d breaks the round; everyone else is honest
        if me == "d":
            self.__class__ = BreakingRunner
            self.mode = mode
        original(self, group, me, *args, **kw)
        runners[me] = self

    monkeypatch.setattr(RoundRunner, "__init__", make)
    results = run(honest_round(members, flats, [1.0] * 4))

    assert all(isinstance(r, AveragingError) for r in results), results
    # d's first other member is a (members in order): a checked d's part, and only a names it.
    assert isinstance(results[0], Malformed) and results[0].peers == {"d"}, results[0]
    assert set(runners["a"].malformed) == {"d"}
    # b and c saw a refuse and close its streams: a failure, not evidence against a (or anyone).
    assert runners["b"].malformed == {} and runners["c"].malformed == {}
    assert not isinstance(results[1], Malformed) and not isinstance(results[2], Malformed)


def runners_made(monkeypatch) -> list[RoundRunner]:
    """The runners the test goes on to make (to read what each one checked)."""
    made, original = [], RoundRunner.__init__

    def make(self, *args, **kw):
        original(self, *args, **kw)
        made.append(self)

    monkeypatch.setattr(RoundRunner, "__init__", make)
    return made


@pytest.mark.parametrize("answer", [dict(digest_of="0" * 64), dict(values=torch.full((PART,), float("inf"))),
                                    dict(total=1.0, cut={"clipped": ["mallory"]})],
                         ids=["digest", "non-finite", "names-non-members"])
def test_an_owner_whose_average_fails_the_members_check_is_named(answer, monkeypatch):
    made = runners_made(monkeypatch)
    outcome, _ = attack(_contribute_honestly, b_serves=_owner_answer(**answer))
    assert isinstance(outcome, PeerFailure) and outcome.peers == {"b"}
    assert set(made[0].malformed) == {"b"}, made[0].malformed


def test_a_refusal_is_no_evidence(monkeypatch):
    async def refuse(stream):  # b refuses a's contribution outright, as a member whose round failed does
        await stream.recv(max_payload=0)
        await stream.refuse("round failed here")

    made = runners_made(monkeypatch)
    outcome, _ = attack(_contribute_honestly, b_serves=refuse)
    assert isinstance(outcome, PeerFailure) and not isinstance(outcome, Malformed)
    assert made[0].malformed == {}


def test_a_runner_of_an_all_honest_round_names_nobody(monkeypatch):
    made = runners_made(monkeypatch)
    results = run(honest_round(("a", "b", "c"), [torch.randn(3 * PART) for _ in range(3)], [1.0] * 3))
    assert not any(isinstance(r, Exception) for r in results)
    assert len(made) == 3 and all(r.malformed == {} for r in made)


# -- what is remembered ---------------------------------------------------------------------------------

def test_offenders_are_remembered_for_a_bounded_number_of_rounds_and_entries(caplog):
    offenders = Offenders(rounds=3, capacity=5)
    with caplog.at_level(logging.WARNING):
        offenders.add("x" * 52, outer_step=10, reason="sent non-finite values")
    assert "sent malformed data in round 10" in caplog.text and "until outer step 13" in caplog.text
    assert offenders.active(13) == ["x" * 52] and offenders.active(14) == []
    for i in range(8):
        offenders.add(f"p{i}", outer_step=20, reason="r")
    assert len(offenders._until) == 5 and "p0" not in offenders  # the oldest went first
    assert offenders.active(20) == ["p7", "p6", "p5", "p4"][:MAX_AVOID]  # the latest caught first
    offenders.add("p3", outer_step=30, reason="again")  # a repeat renews its time
    assert offenders.active(33) == ["p3"]


@pytest.mark.parametrize("value", [None, 3, {"avoid": "x"}, {"avoid": [1, None]}, {"avoid": ["x" * 200]}, {}])
def test_an_announcement_out_of_form_avoids_nobody(value):
    assert announced_avoid(value) == frozenset()


def test_an_announcement_names_at_most_max_avoid_peers():
    assert len(announced_avoid({"avoid": [f"p{i}" for i in range(50)]})) == MAX_AVOID


# -- how refusals shape a group -------------------------------------------------------------------------

HONEST = {"h1", "h2", "h3"}


def test_a_member_caught_by_one_honest_member_is_out_of_the_next_group():
    assert conflict_free(HONEST | {"x"}, {"h2": frozenset({"x"})}) == HONEST
    assert partition(HONEST | {"x"}, {"h2": frozenset({"x"})}) == [HONEST, {"x"}]
    assert part_of("x", HONEST | {"x"}, {"h2": frozenset({"x"})}) == {"x"}


def test_a_liar_keeps_out_at_most_one_honest_member():
    # Naming one honest member without cause: that one is left out of groups the liar is in (the limit).
    assert conflict_free(HONEST | {"x"}, {"x": frozenset({"h1"})}) == {"h2", "h3", "x"}
    # Naming two or more makes the liar the one in the most conflicts: it is the one left out.
    for named in ({"h1", "h2"}, HONEST):
        assert conflict_free(HONEST | {"x"}, {"x": frozenset(named)}) == HONEST
    # Naming back a member that caught it: a tie, decided by id the same way everywhere; once a
    # second honest member catches it, it is out.
    tie = conflict_free(HONEST | {"x"}, {"x": frozenset({"h1"}), "h1": frozenset({"x"})})
    assert len(tie) == 3 and not conflicts(tie, {"x": frozenset({"h1"}), "h1": frozenset({"x"})})
    caught_twice = {"x": frozenset({"h1"}), "h1": frozenset({"x"}), "h2": frozenset({"x"})}
    assert conflict_free(HONEST | {"x"}, caught_twice) == HONEST


def test_the_group_is_the_same_whatever_order_the_announcements_come_in():
    avoids = {"x": frozenset({"h1"}), "h1": frozenset({"x"}), "y": frozenset({"h2", "h3"})}
    peers = ["h1", "h2", "h3", "x", "y"]
    first = partition(peers, avoids)
    for order in itertools.permutations(peers):
        assert partition(order, dict(reversed(list(avoids.items())))) == first
    assert all(not conflicts(part, avoids) for part in first)


# -- the matchmaker: members agree on the group without the offender ---------------------------------

def _form(table, me, workers, offenders=None, results=None, key=RoundKey(2), attempt=1):
    mm = Matchmaker(Writer(table, me), Presence(me, lambda: workers), SETTINGS, "fp16", threading.Event(),
                    offenders=offenders)
    try:
        results[me] = mm.form_group(key, attempt, 10)[0].members
    except AveragingError as e:
        results[me] = e


def test_members_agree_on_a_group_without_the_peer_one_of_them_caught(caplog):
    """h2 caught x in attempt 0: in attempt 1 every member, h2's peers that saw nothing included, forms
    the group without x, whoever leads it (here x's id is the smallest), and x is told why."""
    table = Table()
    workers = {p: WorkerRecord(p, outer_step=2, time=table.clock.now()) for p in ("a-x", "h1", "h2", "h3")}
    caught = Offenders()
    caught.add("a-x", outer_step=2, reason="sent non-finite values")
    results: dict[str, object] = {}
    threads = {p: threading.Thread(target=_form, args=(table, p, workers, caught if p == "h2" else None, results))
               for p in workers}
    with caplog.at_level(logging.WARNING, logger="opendiloco.swarm.matchmaking"):
        threads["h2"].start()  # its announcement first: nobody gives up on it, however slow the machine
        while "h2" not in table.values.get(table.round_key(RoundKey(2)), {}):
            threads["h2"].join(0.01)
        for p, t in threads.items():
            if p != "h2":
                t.start()
        for t in threads.values():
            t.join(30)
    assert results["h1"] == results["h2"] == results["h3"] == ("h1", "h2", "h3"), results
    # Left out: it is alone (a round of one is never applied while the run has others) or behind the
    # group, which is most of the run; either way it is told, in its own log, why.
    assert isinstance(results["a-x"], (AveragingError, BehindError)), results
    assert "1 member(s) refuse to average with this worker" in caplog.text, caplog.text
    assert table.values[table.round_key(RoundKey(2))]["h2"]["avoid"] == ["a-x"]


def test_a_published_group_holding_a_member_and_a_peer_it_avoids_is_not_adopted():
    """An offender that leads (the smallest id) and publishes itself with everyone: no member adopts it."""
    table, key = Table(), RoundKey(2)
    now = table.clock.now()
    workers = {p: WorkerRecord(p, outer_step=2, time=now) for p in ("a-x", "h1", "h2")}
    ann = {"attempt": 1, "numel": 10, "codec": "fp16", "part": SETTINGS.part_numel, "config": "", "since": now}
    table.values[table.round_key(key)] = {"a-x": dict(ann), "h2": dict(ann, avoid=["a-x"])}
    table.values[table.group_key(key, 1)] = {"a-x": ["a-x", "h1", "h2"]}
    results: dict[str, object] = {}
    _form(table, "h1", workers, results=results, key=key)
    assert results["h1"] == ("h1", "h2"), results



# -- members that break attempts without sending anything malformed -----------------------------------

@pytest.mark.parametrize("sender,receiver,blame,named", [
    ("x", "a", frozenset(), True),             # gives up naming nobody: the cause, as far as a can tell
    ("x", "a", frozenset({"x"}), True),        # names itself
    ("x", "a", frozenset({"a"}), True),        # names the receiver, who knows what it sent
    ("x", "a", frozenset({"a", "x"}), True),
    ("h", "a", frozenset({"x"}), False),       # failed because of a third member, and says so
    ("h", "a", frozenset({"x", "a"}), False),
    ("x", "a", frozenset({"b"}), False),       # an insider blaming an honest b escapes a; b names it
    ("x", "b", frozenset({"b"}), True),
    ("x", "a", frozenset({"nobody"}), True),   # a name that is no member of the round counts for nothing
    ("x", "a", frozenset({"nobody", "a"}), True),
])
def test_who_breaks_an_attempt(sender, receiver, blame, named):
    from opendiloco.comm.blame import breaks_attempt
    assert breaks_attempt(sender, receiver, blame, ("a", "b", "h", "x")) is named


@pytest.mark.parametrize("value,expected", [
    (None, frozenset()), ("x", frozenset()), (["a", "b"], frozenset({"a", "b"})), ([1, "a", ""], frozenset({"a"})),
    (["p" * 129], frozenset()), ([f"p{i}" for i in range(40)], frozenset(f"p{i}" for i in range(16))),
])
def test_a_blame_field_is_bounded_and_checked(value, expected):
    from opendiloco.comm.blame import blamed
    assert blamed(value) == expected


@pytest.mark.parametrize("strikes,rounds", [(1, 0), (2, 1), (3, 3), (4, 7), (5, 15), (6, 16), (40, 16)])
def test_a_breaker_is_left_out_longer_at_each_repeat(strikes, rounds):
    from opendiloco.swarm.exclusion import exclusion_rounds
    assert exclusion_rounds(strikes) == rounds


def test_breakers_are_out_for_the_round_then_longer_while_they_keep_at_it_and_forgiven_later():
    from opendiloco.swarm.exclusion import Breakers
    b = Breakers()
    b.add("x", 10, "refused")
    assert b.active(10) == ["x"] and b.active(11) == []  # the rest of that round only
    b.add("x", 11, "refused")
    assert b.active(12) == ["x"] and b.active(13) == []   # one more
    b.add("x", 13, "refused")
    assert b.active(16) == ["x"] and b.active(17) == []   # three more
    b.add("x", 13 + EXCLUDE_ROUNDS + 1, "refused")      # a strike long after the last: a first one again
    assert b.active(13 + EXCLUDE_ROUNDS + 1) == ["x"] and b.active(13 + EXCLUDE_ROUNDS + 2) == []


def _names(**named):
    return {p: frozenset(v) for p, v in named.items()}


@pytest.mark.parametrize("case,refusals,unreachables,broken,min_size,left_out", [
    # One insider x among three honest members that all name it a breaker: the retry runs without it.
    ("insider", {}, {}, dict(a="x", b="x", c="x"), 2, {"x"}),
    # A member that lost its own connections (c) names the two that gave up on it: it is the one in the most
    # conflicts, so it sits the round out, and the other three, a majority, go on.
    ("confused", {}, {}, dict(c="ab"), 2, {"c"}),
    # Two such members naming the other two: every part would be half the run or less (each side would hold
    # as the smaller side of a partition, and the names, lapsing only with the outer step, bind for ever: the
    # CI scenario, once): ignored.
    ("split", {}, {}, dict(c="ab", d="ab"), 2, set()),
    # Two members naming each other in a group of three: the part left holds two of three, a majority.
    ("pair", {}, {}, dict(a="b", b="a"), 2, {"b"}),
    # A run that needs all four: no breaker name is followed.
    ("needs all", {}, {}, dict(a="x", b="x", c="x"), 4, set()),
    # Malformed data always counts, whatever is left.
    ("malformed", dict(a="x", b="x"), {}, {}, 4, {"x"}),
    # Unreachable names count where some part of min_group_size is left...
    ("unreachable", {}, dict(a="x"), {}, 2, {"x"}),
    # ...and not where none is.
    ("unreachable, needs three", {}, dict(a="x"), {}, 4, set()),
])
def test_which_announced_names_shape_a_group(case, refusals, unreachables, broken, min_size, left_out):
    from opendiloco.swarm.match_rule import guarded_avoids
    members = {"pair": {"a", "b", "c"}, "split": {"a", "b", "c", "d"}}.get(case, {"a", "b", "c", "x"})
    avoids = guarded_avoids(members, _names(**refusals), _names(**unreachables), _names(**broken), min_size)
    assert members - conflict_free(members, avoids) == left_out, case
