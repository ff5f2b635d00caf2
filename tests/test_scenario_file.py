"""Scenario files: what is checked before a run starts, and the runner's conditions that follow the
run (an event held until its worker has a checkpoint, an early end once the run has settled).

No namespaces here: the conditions read a worker's run dir, which these tests write as a worker
would; the running worker is a real process.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from opendiloco.testing.scenario import ScenarioError, load_scenario, parse_scenario
from opendiloco.testing.scenario_runner import Instance, ScenarioRunner

ROOT = Path(__file__).resolve().parents[1]

BASE = {
    "name": "t", "duration_s": 60,
    "regions": {"eu": {"delay_ms": 1}},
    "workers": [{"name": "a", "region": "eu"}, {"name": "b", "region": "eu"}],
}


def _with(**changes) -> dict:
    raw = json.loads(json.dumps(BASE))
    raw.update(changes)
    return raw


def test_every_scenario_in_the_repository_loads():
    files = sorted((ROOT / "benchmarks" / "scenarios").glob("*.toml"))
    assert files
    for path in files:
        assert load_scenario(path).workers, path


def test_the_ci_scenario_follows_the_run():
    s = load_scenario(ROOT / "benchmarks" / "scenarios" / "ci.toml")
    assert s.settle_rounds == 2
    kill = next(e for e in s.events if e.action == "kill")
    assert kill.wait_for == "checkpoint"


@pytest.mark.parametrize("raw, place", [
    (_with(settle_rounds=0), "settle_rounds"),
    (_with(settle_rounds=True), "settle_rounds"),
    (_with(settle_rounds=2.5), "settle_rounds"),
    (_with(events=[{"at": 5, "action": "kill", "worker": "a", "wait_for": "round"}]), "events[0].wait_for"),
    (_with(events=[{"at": 5, "action": "heal", "wait_for": "checkpoint"}]), "events[0].wait_for"),
    (_with(events=[{"at": 5, "action": "kill", "worker": "a", "wait-for": "checkpoint"}]), "events[0]: unknown"),
    (_with(events=[{"at": 60, "action": "kill", "worker": "a"}]), "events[0].at"),
])
def test_a_bad_schedule_is_one_line_naming_its_place(raw, place):
    with pytest.raises(ScenarioError) as e:
        parse_scenario(raw)
    assert place in str(e.value) and "\n" not in str(e.value)


@pytest.fixture
def runner(tmp_path):
    s = parse_scenario(_with(settle_rounds=2, workers=[{"name": "a", "region": "eu"},
                                                       {"name": "b", "region": "eu", "clock_offset_s": 30}]))
    r = ScenarioRunner(s, tmp_path / "out", say=lambda msg: None)
    r._t0 = time.time()
    procs = []
    for name in ("a", "b"):
        (r.out / "workers" / name).mkdir(parents=True)
        proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        procs.append(proc)
        r.instances[name].append(Instance(proc, time.time() - 100, resumed=False))
    yield r
    for proc in procs:
        proc.kill()
        proc.wait(10)


def _rounds(r: ScenarioRunner, name: str, *times: float, contributed: int = 10, ok: bool = True) -> None:
    with (r.out / "workers" / name / "metrics.jsonl").open("a") as f:
        for t in times:
            f.write(json.dumps({"event": "outer_step", "time": t, "ok": ok, "contributed_steps": contributed}) + "\n")


def test_a_run_settles_once_every_running_worker_contributed_since_the_last_event(runner):
    since = time.time() - 50
    assert not runner._settled(since, 2)
    _rounds(runner, "a", since + 1, since + 2)
    _rounds(runner, "b", since + 31)  # b's clock is 30 s ahead: this round was at since + 1
    assert not runner._settled(since, 2)
    _rounds(runner, "b", since - 10 + 30)  # before the last event: does not count
    _rounds(runner, "b", since + 40, contributed=0)  # its steps were dropped: does not count
    _rounds(runner, "b", since + 45, ok=False)  # a failed round: does not count
    assert not runner._settled(since, 2)
    runner.frozen.add("b")  # a frozen worker is not waited for
    assert runner._settled(since, 2)
    runner.frozen.clear()
    _rounds(runner, "b", since + 35)
    assert runner._settled(since, 2)
    # Rounds from before a worker's (re)launch do not count for it.
    runner.instances["a"][-1].launched = since + 1.5
    assert not runner._settled(since, 2)
    # A worker that has exited is not waited for.
    runner.instances["a"][-1].proc.kill()
    runner.instances["a"][-1].proc.wait(10)
    assert runner._settled(since, 2)


def test_an_event_waits_for_its_workers_checkpoint_within_the_runs_bound(runner):
    assert not runner._has_checkpoint("a")
    assert runner._wait_until(lambda: runner._has_checkpoint("a"), runner._now() + 1.5) is False
    ckpt = runner.out / "workers" / "a" / "checkpoints"
    ckpt.mkdir()
    (ckpt / "step-000000010.pt").write_bytes(b"x")
    assert runner._wait_until(lambda: runner._has_checkpoint("a"), runner._now() + 30) is True


def test_a_step_reapplied_after_a_heal_is_not_a_lasting_split():
    """The CI scenario once "failed" on a healed fork: worker a applied outer step 1 alone (twice,
    each time healing back to step 0), then again with d, and every later step agreed. Per worker the
    last application of a step stands; a split that lasts is still caught."""
    from opendiloco.testing.scenario_report import _last_steps_agree

    def rec(worker, step, digest, time):
        return {"worker": worker, "outer_step": step, "global_hash": digest, "time": time}

    healed = {1: [rec("a", 1, "alone", 1.0), rec("a", 1, "alone2", 2.0), rec("a", 1, "h1", 5.0),
                  rec("d", 1, "h1", 5.1)],
              2: [rec("a", 2, "h2", 6.0), rec("d", 2, "h2", 6.1), rec("b", 2, "h2", 6.2)]}
    assert _last_steps_agree(healed)
    forked = {**healed, 3: [rec("a", 3, "x", 7.0), rec("d", 3, "y", 7.1)]}
    assert not _last_steps_agree(forked)
    went_back = {1: [rec("a", 1, "h1", 1.0), rec("d", 1, "h1", 1.1), rec("a", 1, "alone", 9.0)]}
    assert not _last_steps_agree(went_back)  # the one that stands is the later, lone one


def test_a_restart_that_resumed_and_then_adopted_the_runs_state_counts_as_resumed():
    """The CI scenario's worker a resumed from its checkpoint (inner step 10), found the run two outer
    steps ahead, and adopted its state at inner step 0: its start record says resumed, at inner step 0.
    The report read that as a fresh start (it asked for inner step > 0 too) and the CI test failed."""
    from opendiloco.testing.scenario_report import resumed_from_checkpoint

    assert resumed_from_checkpoint({"event": "start", "inner_step": 0, "outer_step": 3, "resumed": True})
    assert resumed_from_checkpoint({"event": "start", "inner_step": 10, "outer_step": 1, "resumed": True})
    assert not resumed_from_checkpoint({"event": "start", "inner_step": 0, "outer_step": 0, "resumed": False})
    assert not resumed_from_checkpoint({"event": "start", "inner_step": 0, "outer_step": 0})
