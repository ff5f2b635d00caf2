"""``opendiloco train`` in a real swarm: the CLI worker as users run it."""

from __future__ import annotations

import json
import re
import signal
import stat
import sys
import time
from pathlib import Path

import pytest

from opendiloco.swarm.membership import new_secret_file
from tests.test_train_loop import SMALL

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(120)]
ROOT = Path(__file__).resolve().parents[2]


def test_sigterm_while_waiting_for_peers_stops_at_once(swarm, tmp_path):
    """A worker whose outer step waits for a quorum that never comes leaves on SIGTERM at once, not after
    the matchmaking timeout (600 s here), and still writes its checkpoint and `end` record."""
    peers = swarm.bootstrap()
    run_dir = tmp_path / "alone"
    proc = swarm.spawn([sys.executable, "-m", "opendiloco", "train", *SMALL, "--run.dir", str(run_dir),
                        "--train.total-steps", "100", "--swarm.initial-peers", *peers, "--swarm.open",
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
    proc.wait(120)  # a loaded machine takes seconds to write the checkpoint and stop the daemons
    assert proc.returncode == 0, swarm.log("alone")
    # Not the 600 s it was waiting for (whatever this machine's speed: 16 s beside two other test runs).
    assert time.monotonic() - sent < 120, f"took {time.monotonic() - sent:.1f}s to stop"
    end = json.loads(metrics.read_text().splitlines()[-1])
    assert end["event"] == "end" and end["stopped"] is True and end["outer_step"] == 0, end
    assert (run_dir / "checkpoints" / "latest").is_file()


def test_cli_workers_of_4x_different_speed_average_together_every_round(swarm, tmp_path):
    """The README's swarm (a closed run, as scripts/local_swarm.sh starts it) with one worker 4x slower
    (as on a loaded machine): with the default ``optim.pace = swarm`` both train until the run's end and
    every outer step holds both."""
    peers = swarm.bootstrap()
    secret = tmp_path / "run.secret"
    new_secret_file(str(secret))  # what `opendiloco secret` writes
    procs, dirs = [], {}
    # Rounds of a few seconds (not shorter than the peers' figures take to reach each other).
    for name, throttle in (("fast", "0.1"), ("slow", "0.4")):
        dirs[name] = tmp_path / name
        procs.append(swarm.spawn([sys.executable, "-m", "opendiloco", "train", *SMALL, "--run.dir", str(dirs[name]),
                                  "--run.worker", name, "--train.throttle", throttle, "--train.total-steps", "40",
                                  "--optim.local-steps", "8",
                                  "--swarm.initial-peers", *peers, "--swarm.host-maddrs", "/ip4/127.0.0.1/tcp/0",
                                  "--swarm.min-group-size", "2", "--swarm.join-timeout", "1"], name,
                                 env={"OPENDILOCO_RUN_SECRET_FILE": str(secret)}))
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
    for name in dirs:
        said = swarm.log(name, tail=10**6)
        assert "is closed" in said and "is open" not in said.lower(), said
    fast_steps = sum(r["steps"] for r in rounds["fast"])
    slow_steps = sum(r["steps"] for r in rounds["slow"])
    assert fast_steps > 40 > slow_steps, (fast_steps, slow_steps)


@pytest.mark.timeout(420)
def test_local_swarm_sh_makes_a_run_secret_and_starts_a_closed_run(swarm, tmp_path):
    """The README's main job, scripts/local_swarm.sh, with one small worker: it makes the run's secret in
    its run dir (mode 600), starts the worker with it (a closed run) and tells how to read the run."""
    i = SMALL.index("--run.worker")
    small = SMALL[:i] + SMALL[i + 2:]  # the script names its workers
    run_dir = tmp_path / "run"
    proc = swarm.spawn(["bash", str(ROOT / "scripts/local_swarm.sh"), "-n", "1", "--run-dir", str(run_dir), "--",
                        *small, "--train.total-steps", "4"], "local_swarm")
    swarm.wait_for(lambda: "all workers finished" in swarm.log("local_swarm", tail=10**6), 300,
                   "the worker to finish", alive=[proc], show=["local_swarm"])
    finished = time.monotonic()
    swarm.wait([proc], timeout=120)
    # Once the workers are done, the bootstrap is stopped at once: the script used to wait out its whole
    # 30 s stop grace for the bootstrap (which it had not signalled yet) before signalling it.
    assert time.monotonic() - finished < 30, "local_swarm.sh waited out its stop grace for the bootstrap"
    secret = run_dir / "run.secret"
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert re.fullmatch(r"[0-9a-f]{64}\n", secret.read_text())
    said = swarm.log("local_swarm", tail=10**6)
    assert f"run secret: {secret} (a closed run" in said and f"status --swarm.secret-file {secret} " in said, said
    worker = (run_dir / "logs" / "worker-0.log").read_text()
    assert "is closed" in worker and "is open" not in worker.lower(), worker
    end = json.loads((run_dir / "worker-0" / "metrics.jsonl").read_text().splitlines()[-1])
    assert end["event"] == "end" and end["outer_step"] == 1, end
