"""A closed run against an outsider (no secret) and an insider (the secret, bad intent).

The attackers are small scripts beside this file; the honest workers are tests/swarm/worker.py
started with the run secret in their environment.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import pytest

from opendiloco.swarm.membership import Membership, RunSecret
from opendiloco.swarm.state.transfer import SERVES_PER_PEER
from tests.swarm.conftest import WORKER

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(420)]

HERE = Path(__file__).parent
SECRET = "a-closed-run-secret-0123456789"
RUN = "closed"
HONEST = dict(run_id=RUN, run_until_stopped=True, local_steps=10, step_delay=0.1, straggler_wait=3,
              allreduce_timeout=20, matchmaking_timeout=30, max_wait=15)


def start_honest(swarm, n: int = 2, options=HONEST):
    return [swarm.spawn([sys.executable, str(WORKER), "--peers-file", str(swarm.peers_file), "--out",
                         str(swarm.out(f"honest{i}")), "--seed", str(i + 1)]
                        + [a for k, v in options.items() for a in ((f"--{k.replace('_', '-')}",) if v is True
                                                                   else (f"--{k.replace('_', '-')}", str(v)))],
                        f"honest{i}", env={"OPENDILOCO_RUN_SECRET": SECRET}) for i in range(n)]


HONEST_NAMES = ("honest0", "honest1")


def steps_together(swarm) -> list[int]:
    """Outer steps at which both honest workers hold the same θ_global (from their ok rounds)."""
    by = [{r["outer_step"]: r["global_hash"] for r in swarm.records(f"honest{i}") if r["ok"]} for i in range(2)]
    return sorted(k for k in by[0] if by[1].get(k) == by[0][k])


def stop(swarm, procs, timeout: float = 60.0):
    for proc in procs:
        proc.terminate()
    swarm.wait(procs, timeout=timeout)


def test_an_outsider_can_neither_read_publish_download_nor_contribute(swarm):
    swarm.bootstrap()
    honest = start_honest(swarm)
    swarm.wait_for(lambda: len(steps_together(swarm)) >= 1, 150, "no common outer step", show=HONEST_NAMES)
    ids = [swarm.records(f"honest{i}", "start")[0]["peer_id"] for i in range(2)]
    names = Membership(RUN, RunSecret(SECRET.encode(), "test"))  # the names leak; the secret does not
    before, attacked_at = len(steps_together(swarm)), time.time()
    out = swarm.tmp / "outsider.json"
    attacker = swarm.spawn([sys.executable, str(HERE / "attack_outsider.py"), "--peers-file", str(swarm.peers_file),
                            "--out", str(out), "--run-id", RUN, "--workers-key", f"{names.namespace}.workers",
                            "--state-protocol", f"opendiloco.{names.namespace}.state",
                            "--reduce-protocol", f"opendiloco.{names.namespace}.reduce",
                            "--match-protocol", f"opendiloco.{names.namespace}.match", "--targets", *ids],
                           "outsider")
    swarm.wait([attacker], timeout=120)
    report = json.loads(out.read_text())

    # It found the run's records (it named the key) and learnt nothing from them.
    assert report["raw_records"] >= 2 and not report["plaintext_seen"]
    assert report["open_reader"] == 0 and report["wrong_secret_reader"] == 0
    # Every stream was refused before its protocol began, with or without a made-up proof.
    # (A refusal may race the close of the stream: then the outsider only sees the connection drop.)
    for kind in ("state", "contribute", "ring"):
        assert len(report[kind]) == 4, report
        assert all("not a member of this run" in r or "Connection lost" in r or r.startswith("closed")
                   for r in report[kind]), report
        assert sum("not a member of this run" in r for r in report[kind]) >= 2, report
    # Its record "10**6 steps ahead" was never read as a worker: the run went on, just the two of them.
    swarm.wait_for(lambda: len(steps_together(swarm)) >= before + 3, 150, "the run stalled", show=HONEST_NAMES)
    stop(swarm, honest)
    for i in range(2):
        rounds = swarm.records(f"honest{i}")
        assert all(report["peer_id"] not in r["peers"] for r in rounds)
        assert not any("caught up" in (r["reason"] or "") for r in rounds if r["time"] > attacked_at), rounds


def test_an_insider_cannot_take_over_impersonate_stall_or_exhaust(swarm):
    swarm.bootstrap()
    honest = start_honest(swarm)
    swarm.wait_for(lambda: len(steps_together(swarm)) >= 1, 150, "no common outer step", show=HONEST_NAMES)
    out = swarm.tmp / "insider.json"
    started = time.time()
    attacker = swarm.spawn([sys.executable, str(HERE / "attack_insider.py"), "--peers-file", str(swarm.peers_file),
                            "--out", str(out), "--run-id", RUN, "--duration", "90", "--phase-rounds", "4"], "insider",
                           env={"OPENDILOCO_RUN_SECRET": SECRET})
    swarm.wait([attacker], timeout=240)
    report = json.loads(out.read_text())
    ended = time.time()
    swarm.wait_for(lambda: len([k for k in steps_together(swarm)]) >= 4, 150, "the run stalled", show=HONEST_NAMES)
    stop(swarm, honest)

    # It is a member, so it could download a state once; the hammer got one at a time, a few in all.
    assert report["downloaded_outer_step"] >= 1
    served = report["hammer"].get("served", 0)
    assert 1 <= served <= SERVES_PER_PEER - 1, report["hammer"]  # one of its turns went to the download
    assert sum(n for o, n in report["hammer"].items() if o.startswith("refused")) == 12 - served
    # Records in other workers' names were refused by every DHT node.
    assert report["forged_stores"] and not any(report["forged_stores"])

    for i in range(2):
        rounds = swarm.records(f"honest{i}")
        # No takeover: never a state from anyone while it claimed to be ahead; θ_global stays sane.
        attacked = [r for r in rounds if started <= r["time"] <= ended + 10]
        assert attacked, rounds
        assert not any("caught up" in (r["reason"] or "") or "healed" in (r["reason"] or "") for r in attacked)
        assert all(math.isfinite(r["loss"]) and r["loss"] < 0.5 for r in rounds[-3:]), rounds[-3:]  # θ = 1000: > 1e5
        # No stall: it announced itself "ready in an hour" for the run's rounds; a round waits for it at
        # most max_wait once, then only straggler_wait (it is a no-show), never a whole hour.
        ok = [r["time"] for r in rounds if r["ok"]]
        gaps = [b - a for a, b in zip(ok, ok[1:])]
        assert max(gaps) < HONEST["max_wait"] + HONEST["straggler_wait"] + HONEST["allreduce_timeout"], gaps
        assert sum(gap >= HONEST["max_wait"] for gap in gaps) <= 1, gaps
        assert all(report["peer_id"] not in r["peers"] for r in rounds)
    assert len(steps_together(swarm)) >= 4


def test_workers_of_one_run_id_with_different_secrets_are_told_in_one_line(swarm):
    """Two workers of one run id, one with the secret and one with another (then one with none): they
    live in different namespaces and can never average together; each is told so in one line, instead of
    training alone to the end without a word."""
    swarm.bootstrap()
    args = [a for k, v in HONEST.items() for a in ((f"--{k.replace('_', '-')}",) if v is True
                                                   else (f"--{k.replace('_', '-')}", str(v)))]
    procs = [swarm.spawn([sys.executable, str(WORKER), "--peers-file", str(swarm.peers_file), "--out",
                          str(swarm.out(name)), "--seed", str(i + 1), *args], name, env=env)
             for i, (name, env) in enumerate((("right", {"OPENDILOCO_RUN_SECRET": SECRET}),
                                              ("wrong", {"OPENDILOCO_RUN_SECRET": SECRET + "-typo"}),
                                              ("none", {"OPENDILOCO_RUN_SECRET": ""})))]

    def told(name: str) -> list[str]:
        return [line for line in swarm.log(name, tail=200000).splitlines() if "hold another run secret" in line]

    deadline = time.monotonic() + 180
    while not all(len(told(n)) >= 1 and "2 worker(s)" in told(n)[-1] and swarm.records(n, "start")
                  for n in ("right", "wrong", "none")):
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), \
            {n: swarm.log(n) for n in ("right", "wrong", "none")}
        time.sleep(0.3)
    stop(swarm, procs)
    for name, mine in (("right", "holds this run secret"), ("none", "holds no run secret (an open run)")):
        line = told(name)[-1]
        assert f"of run {RUN!r}" in line and mine in line and "give every worker of the run the same secret" in line
    assert not any(r["group_size"] > 1 for n in ("right", "wrong", "none") for r in swarm.records(n))


def test_identities_that_never_averaged_with_a_worker_neither_take_it_over_stall_it_nor_set_its_pace(swarm):
    """One insider, many keys (``attack_sybil.py``): three records "one step ahead" for a poisoned state
    it serves, then a new identity a second "ready in an hour", then a new identity a second "ready with
    10**12 samples". Two honest workers that have averaged together count only each other's word."""
    options = {**HONEST, "pace": "swarm"}
    swarm.bootstrap()
    honest = start_honest(swarm, options=options)
    swarm.wait_for(lambda: len(steps_together(swarm)) >= 1, 150, "no common outer step", show=HONEST_NAMES)
    out = swarm.tmp / "sybil.json"
    attacker = swarm.spawn([sys.executable, str(HERE / "attack_sybil.py"), "--peers-file", str(swarm.peers_file),
                            "--out", str(out), "--run-id", RUN, "--keys", "3", "--duration", "120",
                            "--phase-rounds", "3"], "sybil",
                           env={"OPENDILOCO_RUN_SECRET": SECRET})
    swarm.wait([attacker], timeout=240)
    report = json.loads(out.read_text())
    stop(swarm, honest)

    def during(rounds, phase):
        began, ended = report[phase]
        return [r for r in rounds if r["ok"] and began + 2 <= r["time"] <= ended]

    for i in range(2):  # the figures, for the record (shown when the test fails)
        rounds = swarm.records(f"honest{i}")
        print(f"honest{i}: caught up/healed {[r['outer_step'] for r in rounds if r['reason']]}, last losses "
              f"{[round(r['loss'], 4) for r in rounds[-3:]]}, round seconds while stalled "
              f"{[round(r['allreduce_s'], 1) for r in during(rounds, 'stall')]}, steps per round while paced "
              f"{[r['steps'] for r in during(rounds, 'pace')]}")
    for i in range(2):
        rounds = swarm.records(f"honest{i}")
        assert all(not set(report["identities"]) & set(r["peers"]) for r in rounds)
        # Takeover: three votes against two, for a state that hashes right: never adopted.
        began, ended = report["takeover"]
        assert not any("caught up" in (r["reason"] or "") or "healed" in (r["reason"] or "")
                       for r in rounds if began <= r["time"] <= ended + 10), rounds
        assert all(math.isfinite(r["loss"]) and r["loss"] < 0.5 for r in rounds[-3:]), rounds[-3:]
        # Stall: each new identity's "ready in an hour" is not believed; a round waits for the
        # unknown peers straggler_wait at most, never max_wait.
        stalled = during(rounds, "stall")
        assert stalled and all(r["allreduce_s"] < HONEST["max_wait"] for r in stalled), stalled
        # Pace: a made-up "ready with 10**12 samples" does not end the rounds early.
        paced = sorted(r["steps"] for r in during(rounds, "pace"))
        assert paced and paced[len(paced) // 2] >= 0.7 * HONEST["local_steps"], paced
    assert report["served"] == 0  # nobody asked for its state
