"""Which groups may apply a round while the run may be split (``swarm/majority.py``)."""

import pytest

from opendiloco.swarm.majority import RecentMembers


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def recent(hold_s=60.0, me="e", rounds=3):
    clock = Clock()
    return RecentMembers(me, hold_s, rounds=rounds, clock=clock), clock


def test_a_worker_that_never_completed_a_round_never_holds():
    r, _ = recent()
    assert r.hold({"e"}) is None
    assert r.reference() == frozenset()


def test_more_than_half_of_the_last_members_go_on_fewer_hold():
    r, _ = recent()
    r.completed("abcde")
    assert r.hold("abce") is None and r.hold("cde") is None
    reason = r.hold("de")
    assert reason and "holds 2 of the 5 workers" in reason
    assert r.hold({"e"})  # alone: the other four may be a side of the run it cannot see


def test_of_two_equal_halves_exactly_one_goes_on():
    r, _ = recent(me="a")
    r.completed("abcd")
    assert r.hold("ab") is None  # holds the smallest id
    other, _ = recent(me="c")
    other.completed("abcd")
    assert other.hold("cd")


def test_the_members_of_the_last_rounds_all_count():
    """A worker missing from the last round (a straggler, a NAT'd worker) still counts for a few rounds."""
    r, _ = recent(rounds=3)
    r.completed("abcdef")
    r.completed("abcde")  # f missed this one
    assert r.reference() == frozenset("abcdef")
    assert r.hold("def")  # exactly half, without the smallest id
    for _ in range(3):
        r.completed("abcde")
    assert r.reference() == frozenset("abcde")  # three rounds without f: it no longer counts
    assert r.hold("cde") is None


def test_workers_gone_one_at_a_time_never_make_the_rest_hold():
    """Each one gone for good stops counting after three rounds without it; only a majority of the last
    rounds' members missing at once (a partition, or a mass crash) makes the rest hold."""
    r, _ = recent(me="a")
    members = set("abcdefgh")
    r.completed(members)
    for gone in "hgfedc":
        members.discard(gone)
        for _ in range(3):
            assert r.hold(members) is None, members
            r.completed(members)
    assert r.reference() == frozenset("ab")


def test_a_hold_ends_after_its_bound_and_the_missing_are_taken_as_gone():
    r, clock = recent(hold_s=60.0)
    r.completed("abcde")
    assert r.hold("de")
    clock.t += 30
    reason = r.hold("de")
    assert reason and "holding for 30s of at most 60s" in reason
    assert r.holding_for() == 30
    clock.t += 30
    assert r.hold("de") is None  # the three it misses may have crashed: it goes on
    assert r.reference() == frozenset()
    r.completed("de")
    assert r.hold("de") is None and r.hold("e")  # measured against the new last round


def test_a_completed_round_ends_a_hold():
    r, clock = recent(hold_s=60.0)
    r.completed("abcde")
    assert r.hold("de")
    clock.t += 50
    r.completed("abcde")  # the partition healed
    assert r.holding_for() == 0
    assert r.hold("de")
    clock.t += 50  # a new hold is measured from its own start
    assert r.hold("de")


def test_zero_never_holds_and_a_negative_bound_is_refused():
    r, _ = recent(hold_s=0)
    r.completed("abcde")
    assert r.hold({"e"}) is None
    with pytest.raises(ValueError, match="partition_hold"):
        RecentMembers("e", -1)


def test_workers_that_said_they_left_do_not_count():
    r, _ = recent()
    r.completed("abcde")
    assert r.hold("de")
    assert r.hold("de", departed="abc") is None  # three stopped cleanly: the two are the whole run
    assert r.hold({"e"}, departed="ab")  # one of the three that are left
    assert r.hold({"e"}, departed="abcde") is None  # itself is never taken as gone
