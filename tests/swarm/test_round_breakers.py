"""An insider that breaks rounds (issue #25, item 5): it sends one malformed part in every group it is in
(tests/swarm/attack_malformed.py). Before, it cost whole rounds: every retry took it back, so each round
failed its three attempts. Now the member whose checks caught it leaves it out of its next groups, and
every member agrees on that group from the announcements: a round loses at most one attempt to it
(when the member that caught it is back in time for the retry), and each group it breaks makes one
more honest member catch it, so it breaks as many groups as there are honest members at most.
"""

from __future__ import annotations

import collections
import datetime
import json
import sys
import time
from pathlib import Path

import pytest

from tests.swarm.conftest import WORKER

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(420)]

ATTACKER = Path(__file__).with_name("attack_malformed.py")
ROUNDS = 8
"""Rounds each honest worker goes through (ok or not) before the test stops the run."""
OPTS = dict(run_id="breakers", run_until_stopped=True, local_steps=10, step_delay=0.05, straggler_wait=4,
            allreduce_timeout=20, matchmaking_timeout=60, min_group_size=2)


def spawn(swarm, script: Path, name: str, *extra: str, **options):
    args = [sys.executable, str(script), "--peers-file", str(swarm.peers_file), "--out", str(swarm.out(name)), *extra]
    for key, value in options.items():
        args += [f"--{key.replace('_', '-')}"] + ([] if value is True else [str(value)])
    return swarm.spawn(args, name)


def attempts(swarm, name: str) -> list[dict]:
    path = Path(str(swarm.out(name)) + ".attempts")
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def caught_at(log: str, peer: str) -> float | None:
    """When (epoch seconds) this worker's own checks first caught ``peer`` sending malformed data."""
    for line in log.splitlines():
        if f"peer {peer[-8:]} sent malformed data" in line:
            stamp = datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")
            return stamp.timestamp()
    return None


def play(swarm, script: Path, *extra: str) -> tuple[list[str], str]:
    """Three honest workers and the insider ``script`` until each honest one went through ``ROUNDS``
    rounds, then stopped: (the honest workers' names, the insider's peer id)."""
    swarm.bootstrap()
    honest = [spawn(swarm, WORKER, f"honest{i}", seed=i + 1, **OPTS) for i in range(3)]
    attacker = spawn(swarm, script, "attacker", *extra, seed=4, **OPTS)
    names = [f"honest{i}" for i in range(3)]
    deadline = time.monotonic() + 300
    while not all(len(swarm.records(n)) >= ROUNDS for n in names):
        assert time.monotonic() < deadline, {n: [(r["ok"], r["reason"]) for r in swarm.records(n)] for n in names}
        assert all(p.poll() is None for p in honest + [attacker]), {n: swarm.log(n) for n in names + ["attacker"]}
        time.sleep(0.3)
    for proc in honest + [attacker]:
        proc.terminate()
    swarm.wait(honest + [attacker], timeout=60)
    return names, swarm.records("attacker", "start")[0]["peer_id"]


@pytest.mark.parametrize("malformed", ["nan", "short"])
def test_a_member_that_sends_malformed_parts_costs_a_round_at_most_one_retry(swarm, malformed):
    names, bad = play(swarm, ATTACKER, "--malformed", malformed)
    logs = {n: swarm.log(n, tail=400000) for n in names + ["attacker"]}
    for name in names:
        rounds = swarm.records(name)[:ROUNDS]
        # It never takes part in a round that completes, and a round loses at most one attempt to it:
        # the member it sent the malformed part to leaves it out of the retry and of later groups. Each
        # group it breaks makes one more honest member catch it, so it breaks few in all (here the first).
        assert not any(bad in r["peers"] for r in rounds if r["ok"]), rounds
        with_it = [a for a in attempts(swarm, name) if bad in a["members"]]
        assert not any(a["ok"] for a in with_it), with_it
        # Once this member caught it, it is in no group of this member again: at most the attempt it was
        # caught in ends after that. (Whether the retry of that round is free of it depends on the member
        # that caught it being back in time for the retry's matchmaking: on a loaded machine it may not
        # be, and the retry forms without it, and with the attacker, which then breaks it too.)
        caught = caught_at(logs[name], bad)
        if caught is not None:
            assert sum(a["time"] >= caught for a in with_it) <= 1, (caught, with_it)
        # What it broke: an attempt that failed on a dial this worker's daemon could not make (the
        # error ``Unreachable``: ten attempts in a row once, at the start of a loaded CI run) failed on
        # the transport, not on anything the attacker sent.
        broken = [a for a in with_it if a["error"] != "Unreachable"]
        assert max(collections.Counter(a["outer_step"] for a in broken).values(), default=0) <= len(names), with_it
        assert len(broken) <= len(names), with_it
        # Nearly every round completes (the first ones may start before every worker is there).
        assert sum(r["ok"] for r in rounds) >= ROUNDS - 2, [(r["ok"], r["reason"]) for r in rounds]
    # Some honest member's own checks caught it, and said so; it is told why, in its own log.
    assert any(f"peer {bad[-8:]} sent malformed data" in logs[n] for n in names), logs
    assert "refuse to average with this worker" in logs["attacker"], logs["attacker"][-5000:]


BREAKER = Path(__file__).with_name("attack_breaker.py")
NAMED = {"refuse": "broke an attempt", "garbage": "answered this worker's audit out of form"}


@pytest.mark.parametrize("breaks", list(NAMED))
def test_a_member_that_refuses_or_answers_audits_with_garbage_is_named_and_left_out(swarm, breaks):
    """tests/swarm/attack_breaker.py refuses every contribution, or answers every audit with garbage.
    Before, neither was blamed: it was taken back into every retry (4 ok rounds and 67 failed attempts in
    the issue's run). Now it is named by the members it broke an attempt of: a garbage answer as malformed
    data (16 outer steps), a refusal that blames no other member for the rest of the round, and longer at
    each repeat. So nearly every round completes, and it breaks at most one attempt of a round."""
    names, bad = play(swarm, BREAKER, "--breaks", breaks)
    logs = {n: swarm.log(n, tail=400000) for n in names}
    for name in names:
        rounds = swarm.records(name)[:ROUNDS]
        assert not any(bad in r["peers"] for r in rounds if r["ok"]), rounds
        with_it = [a for a in attempts(swarm, name) if bad in a["members"] and a["error"] != "Unreachable"]
        # At most one attempt of a round (two where its naming raced the retry's announcement), and in
        # few rounds: it is left out longer at each repeat.
        per_round = collections.Counter(a["outer_step"] for a in with_it)
        assert max(per_round.values(), default=0) <= 2, with_it
        assert len(with_it) <= ROUNDS // 2 + 1, with_it
        assert sum(r["ok"] for r in rounds) >= ROUNDS - 2, [(r["ok"], r["reason"]) for r in rounds]
    assert any(NAMED[breaks] in logs[n] and bad[-8:] in logs[n] for n in names), {n: logs[n][-3000:] for n in names}
