"""An insider that votes with the run and serves its state with one field poisoned (tests/swarm/bad_donor.py,
``--mode poison``): θ_global is the run's, so the hash check passes; everything else is checked
against the joiner's own configuration (opendiloco/state_check.py). Every field is also refused by a
unit test (tests/test_state_check.py); these two runs show the path through the swarm: the joiner
refuses the poisoned donor in one line naming it, takes the state from an honest one, and trains.
"""

from __future__ import annotations

import math
import os
import signal
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(400)]

H = 5


@pytest.mark.parametrize("field", ["inner_steps_total", "momentum_buffer"])
def test_a_joiner_refuses_a_poisoned_state_and_takes_the_honest_one(swarm, tmp_path, field):
    swarm.bootstrap()
    # The honest worker trains two outer steps alone, then stays in the run without training: it holds
    # the run's state (outer step 2) and serves it.
    honest = swarm.worker("honest", outer_steps=2, local_steps=H, linger=True)
    swarm.wait_for(lambda: swarm.records("honest", "linger"), 120, "the honest worker's outer step 2", [honest])
    held = swarm.records("honest", "linger")[0]
    marker = tmp_path / "poisoner"
    poisoner = swarm.spawn([sys.executable, "-m", "tests.swarm.bad_donor", "--peers-file", str(swarm.peers_file),
                            "--run-id", "test", "--mode", "poison", "--poison", field, "--outer-step", "2",
                            "--marker", str(marker)], "poisoner")
    swarm.wait_for(lambda: Path(f"{marker}.up").exists(), 120, "the poisoner", [poisoner])
    bad = Path(f"{marker}.up").read_text()[-8:]

    # The honest worker is stopped until its record has expired: the poisoner is then the only donor of
    # the run's state, so the joiner's first download is the poisoned one.
    os.kill(honest.pid, signal.SIGSTOP)
    try:
        live = Path(f"{marker}.live")
        swarm.wait_for(lambda: live.exists() and not live.read_text().split(), 60, "the honest record to expire",
                       [poisoner])
        joiner = swarm.worker("joiner", outer_steps=4, local_steps=H, join_timeout=240, straggler_wait=3,
                              matchmaking_timeout=10)
        refusal = f"refused the state of donor {bad}: "
        swarm.wait_for(lambda: refusal in swarm.log("joiner", tail=10**6) or swarm.records("joiner", "start"),
                       120, "a download", [joiner])
        assert refusal in swarm.log("joiner", tail=10**6), swarm.records("joiner", "start")  # not adopted
    finally:
        os.kill(honest.pid, signal.SIGCONT)
    # Back in the run: the joiner's next try finds the honest donor.
    swarm.wait_for(lambda: swarm.records("joiner", "start"), 120, "the joiner's start", [joiner])
    start = swarm.records("joiner", "start")[0]
    assert start["downloaded"] and start["outer_step"] == 2, start
    assert start["global_hash"] == held["global_hash"] and start["inner_steps_total"] == held["inner_steps_total"]
    lines = [line for line in swarm.log("joiner", tail=10**6).splitlines() if refusal in line]
    assert lines and all("Traceback" not in line for line in lines), lines
    assert marker.exists()  # it served the poisoned state (and it was refused)

    # The others leave; the joiner trains on, alone, from the honest state.
    for proc in (poisoner, honest):
        proc.terminate()
    swarm.wait([honest], timeout=60)
    swarm.wait([joiner], timeout=240)
    rounds = [r for r in swarm.records("joiner") if r["ok"]]
    assert rounds and rounds[-1]["outer_step"] == 4, swarm.records("joiner")
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["theta_max"]) and r["theta_max"] < 100 for r in rounds)
