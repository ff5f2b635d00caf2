"""This worker's clock against the run's (``swarm/clock.py``): offsets estimated from peers'
heartbeats, the median of the run's clocks, jumps. Clocks are injected, so every case is exact."""

from __future__ import annotations

import logging

import pytest

from opendiloco.pacing import Pace
from opendiloco.swarm import clock as clock_module
from opendiloco.swarm.clock import RunClock


class Clocks:
    """A wall clock and a monotonic clock that the test moves."""

    def __init__(self, wall: float = 1_000_000.0):
        self.wall, self.mono = wall, 50.0

    def advance(self, seconds: float) -> None:
        self.wall += seconds
        self.mono += seconds

    def clock(self) -> RunClock:
        return RunClock(wall=lambda: self.wall, monotonic=lambda: self.mono)


def heartbeats(c: Clocks, clock: RunClock, offsets: dict[str, float], n: int = 5, delay: float = 0.0) -> None:
    """Peers publish every second (their clock = ours + offset) and are read ``delay`` s later."""
    for _ in range(n):
        published = {p: c.wall + off for p, off in offsets.items()}
        c.advance(delay)
        clock.observe(published)
        c.advance(1.0 - delay)


def test_no_peers_no_offset():
    c = Clocks()
    clock = c.clock()
    assert clock.now() == c.wall and clock.offset == 0.0 and clock.isolated() is None


def test_a_worker_behind_the_run_is_told_once_in_one_line_and_its_clock_is_left_alone(caplog):
    c = Clocks()
    clock = c.clock()
    with caplog.at_level(logging.WARNING):
        heartbeats(c, clock, {"a": 12.0, "b": 12.5}, delay=0.3)
    assert clock.offset == pytest.approx(11.7)  # the median of (0, 11.7, 12.2): reads are 0.3 s late
    assert clock.now() == c.wall  # measured and told, not corrected
    [line] = [r.getMessage() for r in caplog.records]
    assert "clock is 11.7 s behind the run's" in line and "NTP" in line


def test_offsets_within_what_the_dht_admits_are_not_told(caplog):
    c = Clocks()
    clock = c.clock()
    with caplog.at_level(logging.WARNING):
        heartbeats(c, clock, {"a": 2.5, "b": -1.0, "c": 2.9})
    assert clock.offset == pytest.approx(1.25) and not caplog.records


def test_one_peer_with_a_wrong_clock_moves_no_one():
    c = Clocks()
    clock = c.clock()
    heartbeats(c, clock, {"a": 0.2, "b": -0.3, "liar": 3000.0})
    assert abs(clock.offset) < 0.2  # the median of (0, 0.2, -0.3, 3000)


def test_the_freshest_read_wins_and_a_record_read_again_is_no_new_sample():
    """A record is read some time after it was written: a sample is low by that delay, never high. A
    frozen peer's record, read again and again, must not look like a clock falling behind."""
    c = Clocks()
    clock = c.clock()
    for delay in (1.8, 0.1, 1.2):
        published = c.wall + 20.0
        c.advance(delay)
        clock.observe({"a": published})
        c.advance(0.5)
    assert clock.offsets() == {"a": pytest.approx(19.9)}
    frozen = c.wall + 20.0
    clock.observe({"b": frozen})
    for _ in range(8):  # the same record, read for 8 s: its writer is frozen
        c.advance(1.0)
        clock.observe({"b": frozen})
    assert clock.offsets()["b"] == pytest.approx(20.0)


def test_old_samples_leave_the_window():
    c = Clocks()
    clock = c.clock()
    clock.observe({"a": c.wall + 30.0})
    c.advance(clock_module.WINDOW_S + 1)
    clock.observe({"b": c.wall + 1.0})
    assert clock.offsets() == {"b": pytest.approx(1.0)}


def test_two_workers_see_the_same_offset_from_either_side():
    a_wall = 1_000_000.0
    a = RunClock(wall=lambda: a_wall, monotonic=lambda: 1.0)
    b = RunClock(wall=lambda: a_wall + 10.0, monotonic=lambda: 1.0)
    a.observe({"b": a_wall + 10.0})
    b.observe({"a": a_wall})
    assert a.offset == pytest.approx(5.0) and b.offset == pytest.approx(-5.0)  # the run's clock: the midpoint


def test_a_jump_is_one_line_and_isolation_lasts_until_a_peer_is_read(caplog):
    c = Clocks()
    clock = c.clock()
    clock.observe({"a": c.wall, "b": c.wall})
    with caplog.at_level(logging.WARNING):
        c.wall += 3600.0  # the wall clock jumps; the monotonic clock does not
        assert "jumped by +3600 s" in clock.isolated()
        assert clock.isolated() is not None  # still: nothing read since
        assert [r.getMessage() for r in caplog.records] == [
            "this machine's clock jumped by +3600.0 s; its offset from the run's is estimated afresh from its "
            "peers' records"]
        heartbeats(c, clock, {"a": -3600.0, "b": -3600.0}, n=3)
    assert clock.isolated() is None
    assert clock.offset == pytest.approx(-3600.0)
    assert "3600.0 s ahead of the run's" in caplog.records[-1].getMessage()


def test_slow_slew_is_not_a_jump():
    c = Clocks()
    clock = c.clock()
    for _ in range(100):
        c.wall += 0.05  # NTP slewing: 50 ms per check, 5 s in all
        clock.now()
    assert clock.isolated() is None


def test_what_peers_can_make_it_keep_is_bounded():
    c = Clocks()
    clock = c.clock()
    clock.observe({f"p{i}": c.wall for i in range(clock_module.MAX_PEERS + 500)})
    clock.observe({"x": float("nan"), "y": "soon", "z": float("inf"), "w": True})
    assert len(clock.offsets()) == clock_module.MAX_PEERS


def test_a_peers_times_are_moved_into_this_clock_when_it_is_half_a_second_off_or_more():
    c = Clocks()
    clock = c.clock()
    heartbeats(c, clock, {"ahead": 2.5, "close": 0.3}, delay=0.1)
    t = c.wall
    assert clock.in_mine("ahead", t + 2.5) == pytest.approx(t + 0.1)  # low by the read's delay, never high
    assert clock.in_mine("close", t + 0.3) == t + 0.3  # within CORRECT_S: as published
    assert clock.in_mine("stranger", t) == t
    assert clock.now() == c.wall  # this worker's own clock is still not moved
    c.wall += 3600.0  # a jump: every estimate was taken against the old clock
    clock.now()
    assert clock.in_mine("ahead", t) == t


def test_a_worker_ahead_of_its_peers_enters_a_round_when_they_do():
    """pace "swarm" extrapolates each peer's work from when its figures were true, on the peer's clock.
    A worker 2.5 s ahead (skew.toml) saw every peer's figures 2.5 s older than they were, believed the
    group's work 2.5 s further on, and entered every round that much early (10 inner steps instead of
    20 at 4 steps a second), then waited for the others."""
    from opendiloco.comm.base import Progress
    from opendiloco.pacing import round_due
    from opendiloco.swarm.records import WorkerRecord

    c = Clocks()  # this worker's clock: the run's + 2.5 s
    clock = c.clock()
    heartbeats(c, clock, {"a": -2.5, "b": -2.5}, delay=0.05)
    true_now = c.wall - 2.5
    # Three workers at 4 inner steps a second, 15 steps into a round of H = 20: the group's 45 of its 60.
    peers = [WorkerRecord.of(Progress(outer_step=3, round_work=15.0, work_rate=4.0, work_per_step=1.0,
                                      pace_time=true_now), peer_id=p, time=true_now, left=False, config="")
             for p in ("a", "b")]
    own = Pace(work=15.0, rate=4.0, per_step=1.0, time=clock.now())
    assert not round_due(own, [r.pace(clock) for r in peers], 20, own_step_s=0.25, local_step=15)
    assert round_due(own, [r.pace() for r in peers], 20, own_step_s=0.25, local_step=15)  # as before: 5 steps early
