"""An insider poisons the average (tests/swarm/attack_poison.py: 60000 everywhere, weight 1e9).

Without bounds one such member took a run from loss 0.06 to 8e15 while every round reported ok.
Now its weight is capped and its parts clipped (named in every round), and with CenteredClip the
honest workers' loss stays close to that of the same swarm without it.
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

import pytest

from tests.swarm.conftest import WORKER

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(300)]

ATTACKER = Path(__file__).with_name("attack_poison.py")
OWNER = Path(__file__).with_name("attack_owner.py")
SILENT_OWNER = Path(__file__).with_name("attack_silent_owner.py")
OPTS = dict(outer_steps=6, local_steps=5, straggler_wait=5, allreduce_timeout=20, matchmaking_timeout=60)


def spawn(swarm, script: Path, name: str, **options):
    args = [sys.executable, str(script), "--peers-file", str(swarm.peers_file), "--out", str(swarm.out(name))]
    for key, value in options.items():
        args += [f"--{key.replace('_', '-')}"] + ([] if value is True else [str(value)])
    return swarm.spawn(args, name)


@pytest.mark.parametrize("aggregation", ["mean", "centered-clip"])
def test_an_insider_cannot_take_over_the_average(swarm, aggregation):
    swarm.bootstrap()
    procs = []
    # The poisoned run: two honest workers and the attacker, every round with all three.
    for i in range(2):
        procs.append(spawn(swarm, WORKER, f"honest{i}", seed=i + 1, run_id="poisoned", min_group_size=3,
                           aggregation=aggregation, **OPTS))
    attacker = spawn(swarm, ATTACKER, "attacker", seed=3, run_id="poisoned", min_group_size=3,
                     aggregation=aggregation, **OPTS)
    # The same two honest workers alone, at the same time, as the reference.
    for i in range(2):
        procs.append(spawn(swarm, WORKER, f"clean{i}", seed=i + 1, run_id="clean", min_group_size=2,
                           aggregation=aggregation, **OPTS))
    swarm.wait(procs + [attacker], timeout=240)

    attacker_id = swarm.records("attacker", "start")[0]["peer_id"]
    for name in ("honest0", "honest1"):
        rounds = swarm.records(name)
        assert [r["outer_step"] for r in rounds if r["ok"]] == list(range(1, 7)), rounds
        for r in rounds:
            assert r["group_size"] == 3 and attacker_id in r["peers"]
            # Every round names the attacker: its claim capped and its values clipped.
            assert r["capped"] == [attacker_id] and attacker_id in r["clipped"], r
    def late_loss(name):  # the last three rounds' training loss: one batch's loss is noisy
        return sum(r["loss"] for r in swarm.records(name)[-3:]) / 3

    poisoned, clean, first = late_loss("honest0"), late_loss("clean0"), swarm.records("clean0")[0]["loss"]
    assert math.isfinite(poisoned)
    if aggregation == "centered-clip":
        # Close to the run without the attacker: under where the run started, within 2x of clean.
        assert poisoned < 2 * clean + 0.05 and poisoned < first, (poisoned, clean, first)
    else:
        # Bounded: the attacker moves each average by at most a few honest steps; no blow-up.
        assert poisoned < 5 * first, (poisoned, clean, first)


OWNERS = {"60000": (OWNER, {"owner_result": "60000"}), "-4x": (OWNER, {"owner_result": "-4x"}),
          # It also leaves every audit request unanswered (-1x: minus the mean, of the mean's own size, so only
          # the audit can tell); "ask" asks every member how the round ended as
          # soon as its results are out. Before, members whose audit stalled failed in doubt, heard "done"
          # from it, and applied the average they held: loss 2e13 in the first poisoned round, nobody named.
          "silent": (SILENT_OWNER, {"owner_result": "-1x"}),
          "silent-ask": (SILENT_OWNER, {"owner_result": "-1x", "ask": True})}


@pytest.mark.parametrize("result", list(OWNERS))
def test_a_shard_owner_cannot_decide_its_shard(swarm, result):
    """An insider that owns a shard sets its result (tests/swarm/attack_owner.py). Before the owners'
    audit, every round was "ok", digests agreeing, nobody named, and the loss went to 1e16. Now every
    member audits random chunks of every other owner's result (and bounds its whole size): the round it
    does so in fails for everyone, it is named, left out of the next groups, and the honest workers go on.
    An owner that does not answer the audit gets no further: a member applies a round only where its own
    audit passed."""
    swarm.bootstrap()
    opts = dict(run_id="owned", run_until_stopped=True, local_steps=10, step_delay=0.05, straggler_wait=4,
                allreduce_timeout=20, matchmaking_timeout=60, min_group_size=2)
    honest = [spawn(swarm, WORKER, f"honest{i}", seed=i + 1, **opts) for i in range(3)]
    script, extra = OWNERS[result]
    owner = spawn(swarm, script, "owner", seed=4, **extra, **opts)
    names = [f"honest{i}" for i in range(3)]
    deadline = time.monotonic() + 240
    while not all(sum(r["ok"] for r in swarm.records(n)) >= 6 for n in names):
        assert time.monotonic() < deadline, {n: [(r["ok"], r["reason"]) for r in swarm.records(n)] for n in names}
        assert all(p.poll() is None for p in honest), {n: swarm.log(n) for n in names}
        time.sleep(0.3)
    for proc in honest + [owner]:
        proc.terminate()
    swarm.wait(honest + [owner], timeout=60)

    bad = swarm.records("owner", "start")[0]["peer_id"]
    for name in names:
        rounds = swarm.records(name)
        # No round it was in was applied: its result never entered θ_global.
        assert all(bad not in r["peers"] for r in rounds if r["ok"]), rounds
        # Training as usual: its result in a round took θ_global to 1e4-1e16 within a few rounds. One
        # batch's loss moves (a worker that lost a round to the attack may step back for a round), so
        # the bounds are the target's own scale (its values lie in [-1, 1]: predicting zero costs about
        # 0.8; twice that is allowed), the late rounds well under it, and θ_global stays of the size
        # honest training gives it (about 1.3 after 6 rounds). Not a trend against the first rounds:
        # training reaches 0.1-0.2 within the first round, and from there one batch's loss alone can
        # read 2.7x its neighbours' (0.27 among 0.10-0.16 in one run; 0.191 against 0.178 in another).
        seen = [(round(r["loss"], 3), r["ok"], round(r["theta_max"], 2), r["reason"]) for r in rounds]
        losses = [r["loss"] for r in rounds]
        assert all(math.isfinite(x) and x < 2.0 for x in losses), seen
        assert sorted(losses[-3:])[1] < 0.5, seen  # the median: one batch of the three may be hard
        assert all(r["theta_max"] < 10.0 for r in rounds), seen
    # It was caught (in some member's log), and left out after that.
    logs = "".join(swarm.log(n, tail=400000) for n in names)
    caught = ("failed this worker's audit", "left this worker's audit unanswered", "larger than its members",
              "broke an attempt")
    assert any(f"{bad[-8:]} {why}" in logs or (why in logs and bad[-8:] in logs) for why in caught), \
        "\n".join([line[:300] for line in logs.splitlines() if bad[-8:] in line][:12])
