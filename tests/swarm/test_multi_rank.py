"""Workers that are torchrun jobs: N local processes (DDP over gloo here), one swarm identity.

Every process of every worker must hold the same θ_global after each outer step, a worker of two
processes must compute what a one-process worker of the same batch computes, and losing one
process (or a whole worker) must leave the rest of the swarm training.
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
from pathlib import Path

import pytest

from opendiloco.swarm.ops.status import fetch_workers
from opendiloco.testing.proctree import children_table, descendants
from tests.test_train_loop import SMALL

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(300)]


def torchrun(nproc: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]


def train_args(run_dir: Path, peers: list[str], run_id: str, *extra: str) -> list[str]:
    return ["-m", "opendiloco", "train", *SMALL, "--run.dir", str(run_dir), "--swarm.initial-peers", *peers,
            "--swarm.open", "--swarm.host-maddrs", "/ip4/127.0.0.1/tcp/0", "--swarm.run-id", run_id,
            "--swarm.join-timeout", "30",
            *extra]


def records(path: Path, event: str = "outer_step") -> list[dict]:
    if not path.is_file():
        return []
    lines = path.read_text().splitlines(keepends=True)
    if lines and not lines[-1].endswith("\n"):  # the worker is writing it right now
        lines.pop()
    return [r for r in map(json.loads, lines) if r["event"] == event]


def hashes(path: Path) -> dict[int, str]:
    return {r["outer_step"]: r["global_hash"] for r in records(path) if r["ok"]}


def rank_pids(agent_pid: int) -> dict[int, int]:
    """The trainer processes a torchrun agent started, by their RANK."""
    found = {}
    for pid in descendants(agent_pid, children_table()):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        env = dict(item.split(b"=", 1) for item in environ if b"=" in item)
        if b"opendiloco" in cmdline and b"RANK" in env and b"torch.distributed.run" not in cmdline:
            found[int(env[b"RANK"])] = pid
    return found


def test_two_workers_of_two_processes_agree_and_match_single_process_workers(swarm, tmp_path):
    """2 workers x 2 gloo ranks: all 4 processes hold the same θ_global at every outer step, and the
    run matches, to fp tolerance, 2 one-process workers of the same batch (run at the same time,
    under another run id, with the same worker names and so the same data).

    Both runs are made the same arithmetic: ``pace = fixed`` with a quorum of 2, and the second
    worker starts once the first waits in its first round, so it joins at the same place in both."""
    peers = swarm.bootstrap()
    common = ("--optim.pace", "fixed", "--swarm.min-group-size", "2", "--swarm.matchmaking-timeout", "150",
              "--train.total-steps", "12", "--train.eval-every", "4")
    launch = {"ranks": [*torchrun(2)], "single": [sys.executable]}
    procs, dirs = [], {}
    for i in range(2):
        for run, head in launch.items():
            name = f"{run}{i}"
            dirs[name] = tmp_path / name
            procs.append(swarm.spawn([*head, *train_args(dirs[name], peers, run, *common, "--run.worker", f"w{i}")],
                                     name, env={"OMP_NUM_THREADS": "1"}))
        if i == 0:
            def waiting(run):
                return any(w.ready and w.outer_step == 0 for w in fetch_workers(peers, run, settle=0.3))

            swarm.wait_for(lambda: all(waiting(run) for run in launch), 150, "the first workers to wait in round 1",
                           show=["ranks0", "single0"])
    swarm.wait(procs, timeout=240)

    leader = {name: records(d / "metrics.jsonl") for name, d in dirs.items()}
    for name, rounds in leader.items():
        assert [r["outer_step"] for r in rounds] == [1, 2, 3], (name, rounds)
        assert all(r["ok"] and r["group_size"] == 2 for r in rounds), (name, rounds)
    # The second worker joined while the first waited in round 1: it took its place in that round
    # (3 of 4 steps done), downloaded through its rank 0 and handed to its rank 1.
    for path in (dirs["ranks1"] / "metrics.jsonl", dirs["ranks1"] / "metrics.rank1.jsonl"):
        assert records(path, "start")[0]["inner_step"] == 3, path
    # One swarm identity per worker: the group of a multi-process worker has two members, not four.
    assert len({p for r in leader["ranks0"] for p in r["peers"]}) == 2
    reference = hashes(dirs["ranks0"] / "metrics.jsonl")
    for i in range(2):
        for path in (dirs[f"ranks{i}"] / "metrics.jsonl", dirs[f"ranks{i}"] / "metrics.rank1.jsonl"):
            assert hashes(path) == reference, path
    # The same arithmetic as one-process workers, up to how DDP sums the two halves of a batch.
    for a, b in zip(records(dirs["ranks0"] / "metrics.jsonl", "eval"), records(dirs["single0"] / "metrics.jsonl",
                                                                            "eval")):
        assert a["inner_step"] == b["inner_step"]
        assert math.isclose(a["eval_loss"], b["eval_loss"], rel_tol=1e-4), (a, b)
    for a, b in zip(leader["ranks0"], leader["single0"]):
        assert math.isclose(a["loss"], b["loss"], rel_tol=1e-4), (a, b)
    # Checkpoints are the worker's, written once: by rank 0, into the worker's run dir.
    files = sorted(p.name for p in (dirs["ranks0"] / "checkpoints").iterdir())
    assert files and not any("rank" in f for f in files), files


@pytest.mark.parametrize("kill", ["one_rank", "whole_worker"])
def test_losing_a_process_or_a_worker_leaves_the_others_training(swarm, tmp_path, kill):
    """A process of a 2-process worker is killed: that worker leaves the swarm (its torchrun job ends
    with an error, no daemon left behind) and the other worker goes on to the end of its run. The same
    when the whole worker (agent and processes) is killed at once."""
    peers = swarm.bootstrap()
    # Killed, a worker of a run of two is half of the survivor's last rounds: the survivor holds for
    # ``partition_hold`` (it may be a partition: swarm/majority.py), then goes on alone.
    common = ("--swarm.min-group-size", "1", "--swarm.straggler-wait", "3", "--swarm.allreduce-timeout", "8",
              "--train.throttle", "0.1", "--swarm.partition-hold", "5")
    survivor_dir, victim_dir = tmp_path / "survivor", tmp_path / "victim"
    survivor = swarm.spawn([sys.executable, *train_args(survivor_dir, peers, "r", *common, "--run.worker", "survivor",
                                                        "--train.total-steps", "100000")], "survivor")
    victim = swarm.spawn([*torchrun(2), *train_args(victim_dir, peers, "r", *common, "--run.worker", "victim",
                                                    "--train.total-steps", "100000")], "victim",
                         env={"OMP_NUM_THREADS": "1"})
    together = lambda: any(r["ok"] and r["group_size"] == 2 for r in records(survivor_dir / "metrics.jsonl"))  # noqa: E731
    swarm.wait_for(together, 200, "both workers to average together", show=["survivor", "victim"])
    ranks = rank_pids(victim.pid)
    assert sorted(ranks) == [0, 1], ranks
    killed_at = len(records(survivor_dir / "metrics.jsonl"))
    if kill == "one_rank":
        os.kill(ranks[1], signal.SIGKILL)
    else:
        for pid in [victim.pid, *ranks.values()]:
            os.kill(pid, signal.SIGKILL)
    victim.wait(90)  # torchrun ends the job when one of its processes dies
    assert victim.returncode != 0
    # The survivor goes on alone: rounds of one (a round or two may still hold, or fail on, the victim).
    after = lambda: records(survivor_dir / "metrics.jsonl")[killed_at:]  # noqa: E731
    swarm.wait_for(lambda: sum(r["ok"] and r["group_size"] == 1 for r in after()) >= 3, 200,
                   "three rounds without the victim", show=["survivor", "victim"])
    assert all(r["group_size"] <= 1 for r in after()[2:]), after()
    survivor.send_signal(signal.SIGTERM)
    swarm.wait([survivor], timeout=60)
    assert records(survivor_dir / "metrics.jsonl", "end")[0]["stopped"]
    if kill == "one_rank":
        # Its rank 0 says why it left in one line, or torchrun's stop ended it first: never a traceback.
        assert "[rank0]: Traceback" not in swarm.log("victim", 100000)
