"""How long a round waits for a peer follows from what the peer published; what status shows of it."""

from opendiloco.swarm.clock import RunClock
from opendiloco.swarm.match_rule import wait_until as rule_wait_until
from opendiloco.swarm.matchmaking import MatchmakingSettings, peers_here
from opendiloco.swarm.ops.status import format_table
from opendiloco.swarm.records import WorkerRecord

SETTINGS = MatchmakingSettings(run_id="r", straggler_wait=5.0, max_wait=600.0)


def wait_until(record, began=1000.0, no_shows=(), clock=None):
    """As matchmaking reads a record: its ready time on this worker's clock, none from a no-show."""
    ready_at = peers_here({record.peer_id: record}, clock or RunClock())[record.peer_id].ready_at
    return rule_wait_until(None if record.peer_id in no_shows else ready_at, began, SETTINGS.straggler_wait,
                           SETTINGS.max_wait)


def test_a_ready_time_is_read_on_this_workers_clock():
    """A peer whose clock is 2.5 s ahead publishes ready times 2.5 s late: it was waited for 2.5 s longer."""
    wall = [1000.0]
    clock = RunClock(wall=lambda: wall[0], monotonic=lambda: 5.0)
    clock.observe({"p": 1002.5})  # its heartbeat, read at once: its clock is ours + 2.5 s
    assert wait_until(WorkerRecord("p", ready_at=1022.5), clock=clock) == 1025.0
    assert wait_until(WorkerRecord("q", ready_at=1022.5), clock=clock) == 1027.5  # no estimate: as published


def test_a_slow_peer_is_waited_for_until_its_own_ready_time_plus_grace():
    # A peer 4x slower says it enters its round 120 s from now: it is waited for, not dropped at a constant.
    assert wait_until(WorkerRecord("p", ready_at=1120.0)) == 1125.0
    assert wait_until(WorkerRecord("p", ready_at=1001.0)) == 1006.0


def test_a_peer_without_a_ready_time_or_past_it_gets_only_the_grace():
    assert wait_until(WorkerRecord("p")) == 1005.0
    assert wait_until(WorkerRecord("p", ready_at=10.0)) == 1005.0  # hung: its promise is long past


def test_no_peer_is_waited_for_longer_than_max_wait():
    assert wait_until(WorkerRecord("p", ready_at=1e9)) == 1600.0


def test_a_no_show_gets_only_the_grace_until_it_takes_part_again():
    # It said "ready at 1120" once and never came: its next promise is not believed.
    assert wait_until(WorkerRecord("p", ready_at=1120.0), no_shows={"p"}) == 1005.0
    assert wait_until(WorkerRecord("q", ready_at=1120.0), no_shows={"p"}) == 1125.0


def test_records_with_bad_numbers_are_ignored():
    assert WorkerRecord.from_value("p", {"outer_step": 1, "work_rate": float("nan")}) is None
    assert WorkerRecord.from_value("p", {"outer_step": 1, "round_work": -3}) is None
    assert WorkerRecord.from_value("p", {"outer_step": 1, "ready_at": float("inf")}) is None
    assert WorkerRecord.from_value("p", {"outer_step": 1, "contributed_steps": float("inf")}) is None
    assert WorkerRecord.from_value("p", {"outer_step": 1, "global_hash": ["not", "a", "hash"]}) is None
    assert WorkerRecord.from_value("p", {"outer_step": 1, "loss": "low"}) is None
    rec = WorkerRecord.from_value("p", {"outer_step": 1, "round_work": 7, "work_rate": 2.5, "ready": 1})
    assert rec.pace().work == 7.0 and rec.pace().rate == 2.5 and rec.ready is True


def test_status_shows_rate_and_contribution_per_worker():
    workers = [WorkerRecord("fast", outer_step=3, steps_per_s=4.0, contributed_steps=90, dropped_steps=0),
               WorkerRecord("slow", outer_step=3, steps_per_s=1.0, contributed_steps=27, dropped_steps=3, ready=True)]
    table = format_table(workers, "r")
    header, fast, slow = table.splitlines()[:3]
    assert "steps/s" in header and "contributed" in header and "dropped" in header
    assert "4.00" in fast and "90 (100%)" in fast
    assert "1.00" in slow and "27 (90%)" in slow and "waiting" in slow


def test_a_peer_with_a_streamed_round_in_flight_is_heading_for_the_next_round():
    assert WorkerRecord("p", outer_step=4).heading == 4
    assert WorkerRecord("p", outer_step=4, next_round=5).heading == 5
