"""Clocks that disagree. DHT records carry absolute times: a worker whose clock is off sees its peers'
records as expired (or writes records that expire before they are read), and its ready times are
wrong by the offset. Clocks are moved per process (a jump mid-run is tested on the
clock alone, tests/test_clock.py). Only the wall clock moves (``opendiloco.testing.faketime``:
libfaketime hangs or breaks Python's timed waits here)."""

from __future__ import annotations

import re
import sys

import pytest

from opendiloco.testing.faketime import clock_off
from tests.swarm.conftest import WORKER
from tests.test_train_loop import SMALL

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(300)]


def by_step(records):
    return {r["outer_step"]: r for r in records if r["ok"]}


def _worker(swarm, name: str, seed: int, *extra: str) -> list[str]:
    return [sys.executable, str(WORKER), "--peers-file", str(swarm.peers_file), "--out", str(swarm.out(name)),
            "--seed", str(seed), "--local-steps", "5", "--min-group-size", "3", *extra]


def test_a_worker_whose_clock_is_a_few_seconds_off_averages_with_the_others(swarm):
    swarm.bootstrap()
    names = ["w0", "w1", "skew"]
    procs = []
    for i, n in enumerate(names):
        args = _worker(swarm, n, i + 1, "--outer-steps", "4")
        procs.append(swarm.spawn(clock_off(args, 2.5) if n == "skew" else args, n))
    swarm.wait(procs, timeout=200)
    syncs = {n: by_step(swarm.records(n)) for n in names}
    for n in names:
        assert sorted(syncs[n]) == [1, 2, 3, 4], swarm.log(n)
    for step in range(1, 5):
        assert {syncs[n][step]["group_size"] for n in names} == {3}, step
        assert len({syncs[n][step]["global_hash"] for n in names}) == 1, step


def test_a_clock_too_far_off_to_join_is_one_line(swarm, tmp_path):
    """The DHT refuses a node whose clock is more than 3 s off its initial peer's: the user is told that
    it is the clock, not left with the DHT's message."""
    peers = swarm.bootstrap()
    proc = swarm.spawn(clock_off([sys.executable, "-m", "opendiloco", "train", *SMALL, "--run.dir",
                                  str(tmp_path / "run"), "--swarm.open", "--swarm.initial-peers", *peers], -30), "late")
    proc.wait(120)
    lines = swarm.log("late", tail=20000).strip().splitlines()
    assert proc.returncode == 2, lines
    assert not any("Traceback" in line for line in lines), lines
    # The offset is measured over the network (half a round trip and the peer's answer time are in it):
    # about 30 s, to the tenth it may read 30.1 on a loaded machine.
    found = re.match(r"opendiloco train: this machine's clock is ([\d.]+) s behind the initial peer's", lines[-1])
    assert found and 29.5 <= float(found.group(1)) <= 31.0, lines[-1]

