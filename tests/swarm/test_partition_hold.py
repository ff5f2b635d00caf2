"""A worker cut off from most of the workers it averaged with holds its work instead of going on alone.

Three workers average together; then two of them are frozen (SIGSTOP): they send nothing and their
records expire, which is all the third can see of a partition. Before, the third then averaged alone
round after round (its bootstrap still answered, so it was not "cut off"), and when the two came
back, the run held two values of θ_global at the same outer steps: a fork, which the third healed
by going back and dropping its work. Now it holds (``swarm/majority.py``): its outer step does not
move while the two are away, it keeps training, and the work of those steps goes into the first
round with them, which all three apply alike.
"""

import contextlib
import json
import os
import signal
import sys

import pytest

from opendiloco.testing.proctree import descendants
from tests.test_train_loop import SMALL

from .test_resilience import assert_hashes_agree, ok_syncs

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(300)]

OPTS = dict(run_until_stopped=True, local_steps=5, step_delay=0.1, straggler_wait=3, allreduce_timeout=8, pace="swarm")


def held(swarm, name):
    return [r for r in swarm.records(name) if not r["ok"] and "the run may be split" in r["reason"]]


def three_together(swarm):
    """Three workers that have averaged twice all together: their processes and names."""
    swarm.bootstrap()
    procs = [swarm.worker(f"w{i}", seed=i + 1, **OPTS) for i in range(3)]
    names = [f"w{i}" for i in range(3)]
    swarm.wait_for(lambda: all(sum(r["group_size"] == 3 for r in ok_syncs(swarm, n).values()) >= 2 for n in names),
                   150, "two rounds of all three", show=names)
    return procs, names


def test_a_worker_cut_off_from_most_of_its_run_holds_its_work_and_the_run_does_not_fork(swarm):
    procs, names = three_together(swarm)
    for proc in procs[1:]:
        os.kill(proc.pid, signal.SIGSTOP)
    frozen_at = max(ok_syncs(swarm, "w0"))

    def alone():  # rounds w0 applied without the two: at most the one in flight when they froze was theirs too
        return [r for s, r in ok_syncs(swarm, "w0").items() if s > frozen_at and r["group_size"] < 3]

    try:
        # Twice it finds itself without them (not one failed round by chance): it holds every time.
        swarm.wait_for(lambda: len(held(swarm, "w0")) + len(alone()) >= 2, 150, "w0 to go on without the two",
                       alive=procs[:1], show=["w0"])
        assert not alone(), alone()
    finally:
        for proc in procs[1:]:
            os.kill(proc.pid, signal.SIGCONT)
    after = max(ok_syncs(swarm, "w0"))
    swarm.wait_for(lambda: any(s > after and r["group_size"] == 3 for s, r in ok_syncs(swarm, "w0").items()),
                   150, "a round of all three after the thaw", show=names)
    for proc in procs:
        proc.send_signal(signal.SIGTERM)
    swarm.wait(procs, timeout=60)

    # One θ_global per outer step, whoever applied it.
    assert_hashes_agree(swarm, names, sorted(ok_syncs(swarm, "w0")))
    w0 = swarm.records("w0")
    # Its held work was carried, not dropped, into its first round back. (The round in flight at
    # the freeze may have failed here in doubt after the two completed it: its steps are accounted for by
    # the in-doubt rule, before the first hold.)
    first_hold = next(i for i, r in enumerate(w0) if r in held(swarm, "w0"))
    assert sum(r["dropped"] for r in w0[first_hold:]) == 0, w0[first_hold:]
    last_hold = max(i for i, r in enumerate(w0) if r in held(swarm, "w0"))
    first_back = next(r for r in w0[last_hold:] if r["ok"])  # with both, or with the first of them back
    assert first_back["group_size"] >= 2 and first_back["contributed"] > OPTS["local_steps"], w0[last_hold:]


def test_workers_that_stop_cleanly_leave_the_rest_going_on_without_a_hold(swarm):
    """A worker stopped with SIGTERM says it left: it is not missing, and the rest do not hold for it."""
    procs, _ = three_together(swarm)
    for proc in procs[1:]:
        proc.send_signal(signal.SIGTERM)
    swarm.wait(procs[1:], timeout=60)
    stopped_at = max(ok_syncs(swarm, "w0"))
    swarm.wait_for(lambda: sum(r["group_size"] == 1 for s, r in ok_syncs(swarm, "w0").items() if s > stopped_at) >= 2,
                   150, "w0 to go on alone", alive=procs[:1], show=["w0"])
    procs[0].send_signal(signal.SIGTERM)
    swarm.wait(procs[:1], timeout=60)
    assert not held(swarm, "w0"), held(swarm, "w0")


@pytest.mark.timeout(420)
def test_workers_crashed_and_resumed_come_back_as_the_same_peers_and_nobody_holds(swarm, tmp_path):
    """Three ``opendiloco train`` workers; two crash (SIGKILL, with their daemons) and are restarted with
    ``--resume``. They keep their peer identities (``peer.key`` in the run dir), so the third counts them
    as back and the three average together again. With a new peer id per launch (the code before), the
    third's last rounds held two members that never came back: it held every round for
    ``partition_hold`` (an hour here) while the two averaged without it."""
    peers = swarm.bootstrap()
    common = ["--swarm.initial-peers", *peers, "--swarm.open", "--swarm.host-maddrs", "/ip4/127.0.0.1/tcp/0",
              "--swarm.min-group-size", "2", "--swarm.join-timeout", "1", "--swarm.straggler-wait", "3",
              "--swarm.allreduce-timeout", "8", "--swarm.partition-hold", "3600", "--train.throttle", "0.1",
              "--train.total-steps", "100000", "--checkpoint.every-outer-steps", "1"]
    names = ["a", "b", "c"]
    dirs = {n: tmp_path / n for n in names}

    def launch(name, *extra):
        return swarm.spawn([sys.executable, "-m", "opendiloco", "train", *SMALL, "--run.dir", str(dirs[name]),
                            "--run.worker", name, *common, *extra], name)

    def rounds(name):
        path = dirs[name] / "metrics.jsonl"
        records = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
        return [r for r in records if r["event"] == "outer_step"]

    def peer_ids(name):
        path = dirs[name] / "metrics.jsonl"
        return [json.loads(line)["peer_id"] for line in path.read_text().splitlines() if '"event": "start"' in line]

    procs = {n: launch(n) for n in names}
    swarm.wait_for(lambda: all(sum(r["ok"] and r["group_size"] == 3 for r in rounds(n)) >= 2 for n in names),
                   200, "two rounds of all three", show=names)
    for name in ("a", "b"):  # a crash: the worker and its DHT process and daemon, no goodbye
        pids = [procs[name].pid, *descendants(procs[name].pid)]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        procs[name].wait(30)
    crashed_at = len(rounds("c"))
    for name in ("a", "b"):
        procs[name] = launch(name, "--resume")
    back = lambda: [r for r in rounds("c")[crashed_at:] if r["ok"] and r["group_size"] == 3]  # noqa: E731
    swarm.wait_for(lambda: len(back()) >= 2, 240, "two rounds of all three after the restarts",
                   alive=[procs["c"]], show=names)
    for proc in procs.values():
        proc.send_signal(signal.SIGTERM)
    swarm.wait(list(procs.values()), timeout=90)
    for name in ("a", "b"):
        ids = peer_ids(name)
        assert len(ids) == 2 and ids[0] == ids[1], ids
    # It never held: every group it could form held most of its last rounds' members.
    assert not [r for r in rounds("c")[crashed_at:] if r["held"]], rounds("c")[crashed_at:]
