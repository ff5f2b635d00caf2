"""``opendiloco train`` in a real swarm: the CLI worker as users run it."""

from __future__ import annotations

import json
import signal
import sys
import time

import pytest

from tests.test_train_loop import SMALL

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(120)]


def test_sigterm_while_waiting_for_peers_stops_at_once(swarm, tmp_path):
    """A worker whose outer step waits for a quorum that never comes leaves on SIGTERM within seconds,
    not after the matchmaking timeout, and still writes its checkpoint and `end` record."""
    peers = swarm.bootstrap()
    run_dir = tmp_path / "alone"
    proc = swarm.spawn([sys.executable, "-m", "opendiloco", "train", *SMALL, "--run.dir", str(run_dir),
                        "--train.total-steps", "100", "--swarm.initial-peers", *peers,
                        "--swarm.host-maddrs", "/ip4/127.0.0.1/tcp/0", "--swarm.min-group-size", "2",
                        "--swarm.matchmaking-timeout", "600", "--swarm.straggler-wait", "600",
                        "--swarm.join-timeout", "1"], "alone")
    # It takes 4 inner steps (a few ms each), then waits for a second worker in its first outer step.
    deadline = time.monotonic() + 90
    metrics = run_dir / "metrics.jsonl"
    while not (metrics.is_file() and '"inner_step": 2' in metrics.read_text()):
        assert proc.poll() is None and time.monotonic() < deadline, swarm.log("alone")
        time.sleep(0.2)
    time.sleep(2.0)  # well inside matchmaking now
    assert proc.poll() is None, swarm.log("alone")
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    proc.wait(30)
    assert proc.returncode == 0, swarm.log("alone")
    assert time.monotonic() - sent < 15, f"took {time.monotonic() - sent:.1f}s to stop"
    end = json.loads(metrics.read_text().splitlines()[-1])
    assert end["event"] == "end" and end["stopped"] is True and end["outer_step"] == 0, end
    assert (run_dir / "checkpoints" / "latest").is_file()


def test_cli_workers_of_4x_different_speed_average_together_every_round(swarm, tmp_path):
    """The README's swarm with one worker 4x slower (as on a loaded machine): with the default
    ``optim.pace = swarm`` both train until the run's end and every outer step holds both."""
    peers = swarm.bootstrap()
    procs, dirs = [], {}
    # Rounds of a few seconds (not shorter than the peers' figures take to reach each other).
    for name, throttle in (("fast", "0.1"), ("slow", "0.4")):
        dirs[name] = tmp_path / name
        procs.append(swarm.spawn([sys.executable, "-m", "opendiloco", "train", *SMALL, "--run.dir", str(dirs[name]),
                                  "--run.worker", name, "--train.throttle", throttle, "--train.total-steps", "40",
                                  "--optim.local-steps", "8",
                                  "--swarm.initial-peers", *peers, "--swarm.host-maddrs", "/ip4/127.0.0.1/tcp/0",
                                  "--swarm.min-group-size", "2", "--swarm.join-timeout", "1"], name))
    swarm.wait(procs, timeout=100)
    rounds = {}
    for name in dirs:
        records = [json.loads(line) for line in (dirs[name] / "metrics.jsonl").read_text().splitlines()]
        rounds[name] = [r for r in records if r["event"] == "outer_step"]
        end = records[-1]
        # 40 steps at H=8 are 5 outer steps for the run, however many inner steps each worker took.
        assert end["event"] == "end" and end["outer_step"] == 5 and end["dropped_steps"] == 0, end
    assert [r["outer_step"] for r in rounds["fast"]] == list(range(1, 6))
    for name in dirs:
        assert all(r["ok"] and r["group_size"] == 2 for r in rounds[name]), rounds[name]
    assert [r["global_hash"] for r in rounds["fast"]] == [r["global_hash"] for r in rounds["slow"]]
    fast_steps = sum(r["steps"] for r in rounds["fast"])
    slow_steps = sum(r["steps"] for r in rounds["slow"])
    assert fast_steps > 40 > slow_steps, (fast_steps, slow_steps)
