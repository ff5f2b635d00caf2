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
