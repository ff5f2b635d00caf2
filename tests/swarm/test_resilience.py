"""Faults on a real swarm: late joiners, a worker killed or frozen mid all-reduce, drift, NaNs, quorum."""

import os
import re
import signal
import time

import pytest

from opendiloco.testing.proctree import descendants

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(300)]

FAST = dict(straggler_wait=3, allreduce_timeout=8)
FROZEN_TIMEOUT = 90
"""The exchange's timeout while a member is frozen: far longer than its record lives (8 s)."""


def ok_syncs(swarm, name):
    return {r["outer_step"]: r for r in swarm.records(name) if r["ok"]}


def assert_hashes_agree(swarm, names, steps):
    for step in steps:
        hashes = {n: ok_syncs(swarm, n)[step]["global_hash"] for n in names if step in ok_syncs(swarm, n)}
        assert len(set(hashes.values())) == 1, f"outer step {step}: {hashes}"


def test_late_joiner_downloads_state_and_trains_in_step(swarm):
    swarm.bootstrap()
    # Everyone trains until the test stops them, so that the joiner gets its rounds however fast
    # this machine runs the others.
    opts = dict(run_until_stopped=True, local_steps=5, step_delay=0.2, min_group_size=2, **FAST)
    early = [swarm.worker(f"w{i}", seed=i + 1, **opts) for i in range(2)]
    swarm.wait_for(lambda: all(len(ok_syncs(swarm, f"w{i}")) >= 2 for i in range(2)), 120, "two outer steps",
                   show=["w0", "w1"])
    late = swarm.worker("w2", seed=3, **opts)
    swarm.wait_for(lambda: sum(r["group_size"] == 3 for r in ok_syncs(swarm, "w2").values()) >= 2, 120,
                   "the joiner to average twice with the others", show=["w0", "w2"])
    for proc in early + [late]:
        proc.send_signal(signal.SIGTERM)
    swarm.wait(early + [late], timeout=60)

    start = swarm.records("w2", "start")[0]
    assert start["downloaded"] and start["outer_step"] >= 2, start
    # It took the state in parts (multi_donor.py) from the workers whose records were at the state the
    # run confirms when it read them: both, or one if the other had not yet recorded that step (how
    # many is a race with the others' rounds; several donors at once are test_multi_donor.py's).
    took = re.search(rf"downloaded state of outer step {start['outer_step']} in parts from (\d) of (\d) donor",
                     swarm.log("w2", 1_000_000))
    assert took and 1 <= int(took[1]) <= int(took[2]) <= 2, swarm.log("w2")
    # It starts from exactly the θ_global the others had at that outer step...
    assert start["global_hash"] == ok_syncs(swarm, "w0")[start["outer_step"]]["global_hash"]
    # ...takes the group's position in the round, so that its first round is the group's round of that
    # outer step, instead of one of its own that would hold the others up (whether it makes that round
    # depends on how fast this machine runs it against the others; it averages with them either way)...
    assert swarm.records("w2")[0]["before"] == start["outer_step"], swarm.records("w2")
    joined = sorted(ok_syncs(swarm, "w2"))
    assert sum(r["dropped"] for r in swarm.records("w2")) <= 5
    # ...and from its first sync on agrees with them bit for bit, in one group of three.
    assert_hashes_agree(swarm, ["w0", "w1", "w2"], joined)
    assert all(ok_syncs(swarm, "w0")[s]["group_size"] == 3 for s in joined)
    print(f"\nlate join: downloaded state of outer step {start['outer_step']} ({start['numel']} parameters) "
          f"in {start['download_s']:.2f}s")


def _thaw(pids: list[int]) -> None:
    for pid in reversed(pids):  # its daemon first
        os.kill(pid, signal.SIGCONT)


@pytest.mark.parametrize("fault", ["kill", "stop", "freeze"])
def test_peer_lost_mid_allreduce_survivors_finish_and_it_catches_up(swarm, fault):
    """A member killed, stopped or frozen mid-all-reduce. Killed, its streams close. Stopped (SIGSTOP to
    the worker alone: its p2p daemon still echoes pings), it sends nothing and closes nothing, and the
    survivors give up on it once its record has expired, not at the exchange's timeout (given a long one
    here: before, they waited it out). Frozen (SIGSTOP to the worker and its daemon: a paused machine),
    it leaves their pings unanswered while they echo each other's, and they give up on it for that,
    its record still alive (it outlives the exchange's timeout here)."""
    swarm.bootstrap()
    # The survivors train until the test stops them (SIGTERM), so that they are still there to be
    # caught up from however fast this machine runs them.
    timeouts = FAST if fault == "kill" else {**FAST, "allreduce_timeout": FROZEN_TIMEOUT}
    if fault == "freeze":
        timeouts["record_ttl"] = 2 * FROZEN_TIMEOUT
    opts = dict(outer_steps=100_000, local_steps=5, step_delay=0.15, min_group_size=2, **timeouts)
    survivors = [swarm.worker(f"w{i}", seed=i + 1, **opts) for i in range(2)]
    victim = swarm.worker("victim", seed=9, stall_in_allreduce=(2, 30), **opts)
    marker = swarm.out("victim").with_name("victim.jsonl.inround")
    # Written, not only made: the file appears before its line does (an empty read, once, in CI).
    swarm.wait_for(lambda: marker.exists() and marker.read_text().split(), 120,
                   "the victim to enter an all-reduce at or after outer step 2", show=["victim", "w0"])
    hit = time.time()
    frozen = [victim.pid] + (descendants(victim.pid) if fault == "freeze" else [])
    for pid in frozen:
        os.kill(pid, signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
    try:
        # The round it stalled in: outer step 2, or a later one if the others ran ahead while it started.
        after = int(marker.read_text().split()[0]) + 1

        swarm.wait_for(lambda: all(after in ok_syncs(swarm, f"w{i}") for i in range(2)), FROZEN_TIMEOUT,
                       "survivors to finish the round", show=["w0", "w1"])
        held = max(ok_syncs(swarm, f"w{i}")[after]["time"] for i in range(2)) - hit
        for i in range(2):
            rec = ok_syncs(swarm, f"w{i}")[after]
            assert rec["group_size"] == 2, rec  # the victim's contribution is not in it
        logs = "\n".join(swarm.log(f"w{i}", tail=200000) for i in range(2))
        if fault == "kill":  # held up by at most the all-reduce timeout plus matchmaking slack, not the 30 s stall
            assert held < FAST["allreduce_timeout"] + FAST["straggler_wait"] + 8, held
        elif fault == "stop":  # its record expired (8 s after its last heartbeat) long before the exchange's timeout
            assert held < FROZEN_TIMEOUT, held
            assert "gone from the run's records" in logs, swarm.log("w0")
            assert "left a ping unanswered" not in logs, swarm.log("w0")  # its daemon echoed: alive, as far as it knows
        else:  # its record still lives: an unanswered ping while the other survivor echoed
            assert held < FROZEN_TIMEOUT, held
            assert re.search(r"member \w+ left a ping unanswered", logs), swarm.log("w0")
            assert "gone from the run's records" not in logs, swarm.log("w0")
    except BaseException:
        if fault != "kill":  # so that the harness's SIGTERM ends it
            _thaw(frozen)
        raise
    print(f"\n{fault}: survivors completed the outer step {held:.1f}s after the fault")

    if fault == "kill":
        victim.wait(10)
        # Restarted with the same command, it rejoins and catches up.
        back = swarm.worker("victim2", seed=9, **opts)
        name = "victim2"
    else:
        time.sleep(1)
        _thaw(frozen)
        back, name = victim, "victim"
    # It comes back behind: it loads state from a peer instead of contributing a stale round, then
    # averages with the others again.
    caught_up = (lambda: swarm.records(name, "start")[0]["downloaded"]) if fault == "kill" else \
        (lambda: any(r["reason"] == "caught up from a peer" for r in swarm.records(name)))
    swarm.wait_for(lambda: swarm.records(name, "start") and caught_up()
                   and sum(r["group_size"] == 3 for r in ok_syncs(swarm, name).values()) >= 2,
                   180, f"{name} to catch up and average with the others again", show=[name, "w0"])
    for proc in survivors + [back]:
        proc.send_signal(signal.SIGTERM)
    swarm.wait(survivors + [back], timeout=60)
    if fault == "kill":
        assert swarm.records(name, "start")[0]["outer_step"] >= after
    steps = sorted(ok_syncs(swarm, name))
    assert_hashes_agree(swarm, ["w0", "w1", name], steps)


@pytest.mark.parametrize("fault", ["freeze", "kill"])
def test_a_peer_frozen_or_killed_on_its_way_to_a_round_is_not_waited_for(swarm, fault):
    """A worker and its daemon frozen (a paused machine) or killed while they train: its record lives on
    and says it is coming, so its peers used to wait for it until their grace or its record ran out (a
    minute each here). They ping it instead, and a peer that leaves the ping unanswered (frozen) or
    fails it (killed: its address refuses the dial) while the other echoes is neither waited for nor
    grouped with. Thawed, it catches up and averages with them again."""
    swarm.bootstrap()
    opts = dict(outer_steps=100_000, local_steps=5, step_delay=0.15, min_group_size=2, straggler_wait=60,
                allreduce_timeout=FROZEN_TIMEOUT, record_ttl=2 * FROZEN_TIMEOUT)
    procs = [swarm.worker(name, seed=i + 1, **opts) for i, name in enumerate(["w0", "w1", "victim"])]
    swarm.wait_for(lambda: sum(r["group_size"] == 3 for r in ok_syncs(swarm, "victim").values()) >= 2, 120,
                   "two rounds of three", show=["victim", "w0"])
    victim_id = swarm.records("victim", "start")[0]["peer_id"][-8:]
    frozen = [procs[2].pid] + descendants(procs[2].pid)
    for pid in frozen:
        os.kill(pid, signal.SIGSTOP if fault == "freeze" else signal.SIGKILL)
    hit = time.time()
    try:
        def without_it(name):
            return [r for r in ok_syncs(swarm, name).values() if r["time"] > hit and r["group_size"] == 2]
        swarm.wait_for(lambda: all(len(without_it(n)) >= 2 for n in ("w0", "w1")), FROZEN_TIMEOUT,
                       f"two rounds of the others without the {fault} one", show=["w0", "w1"])
        logs = "\n".join(swarm.log(n, tail=200000) for n in ("w0", "w1"))
        assert re.search(rf"a group of 2 without \w*{victim_id} \([^)]*frozen\)", logs), swarm.log("w0")
    finally:
        if fault == "freeze":
            _thaw(frozen)
    alive = procs if fault == "freeze" else procs[:2]
    if fault == "freeze":
        swarm.wait_for(lambda: any(r["reason"] == "caught up from a peer" for r in swarm.records("victim"))
                       and any(r["group_size"] == 3 and r["time"] > hit for r in ok_syncs(swarm, "victim").values()),
                       180, "the thawed worker to catch up and average with the others again", show=["victim", "w0"])
    for proc in alive:
        proc.send_signal(signal.SIGTERM)
    swarm.wait(alive, timeout=60)
    names = ["w0", "w1", "victim"] if fault == "freeze" else ["w0", "w1"]
    assert_hashes_agree(swarm, names, sorted(ok_syncs(swarm, names[-1])))


def test_drift_is_detected_and_healed(swarm):
    swarm.bootstrap()
    last = 7  # slack: a round that fails on a busy machine only postpones the corruption
    opts = dict(outer_steps=last, local_steps=5, step_delay=0.02, min_group_size=3, **FAST)
    procs = [swarm.worker(f"w{i}", seed=i + 1, **opts) for i in range(2)]
    procs.append(swarm.worker("drifter", seed=7, corrupt_at=2, **opts))
    swarm.wait(procs, timeout=180)
    drifter = swarm.records("drifter")
    assert any("drift" in r["reason"] for r in drifter), drifter
    final = {n: [r for r in swarm.records(n, "sync") if r["outer_step"] == last] for n in ("drifter", "w0")}
    assert final["drifter"] and final["w0"], final  # healed: it ends on the others' θ_global
    assert final["drifter"][-1]["global_hash"] == final["w0"][-1]["global_hash"]
    assert_hashes_agree(swarm, ["w0", "w1"], sorted(ok_syncs(swarm, "w0")))


def test_non_finite_pseudo_gradient_is_not_sent(swarm):
    swarm.bootstrap()
    opts = dict(outer_steps=3, local_steps=5, min_group_size=3, dump=swarm.tmp, **FAST)
    procs = [swarm.worker(f"w{i}", seed=i + 1, **opts) for i in range(2)]
    procs.append(swarm.worker("nan", seed=5, poison_at=1, **opts))
    swarm.wait(procs, timeout=180)
    for name in ("w0", "w1", "nan"):
        assert sorted(ok_syncs(swarm, name)) == [1, 2, 3], swarm.records(name)
    assert_hashes_agree(swarm, ["w0", "w1", "nan"], [1, 2, 3])

    import torch

    peers = {n: swarm.records(n, "start")[0]["peer_id"] for n in ("w0", "w1", "nan")}
    dumps = {n: torch.load(swarm.tmp / f"{peers[n]}-1.pt") for n in peers}
    assert all(torch.isfinite(t).all() for t in dumps["nan"]["sent"])  # zeros went out, not NaN
    reference = (dumps["w0"]["sent"][0].half().float() + dumps["w1"]["sent"][0].half().float()) / 2
    torch.testing.assert_close(dumps["w0"]["got"][0], reference, rtol=2e-3, atol=2e-3)  # weight 0 for it


def test_quorum_not_reached_is_a_clear_failure_not_a_hang(swarm):
    swarm.bootstrap()
    opts = dict(outer_steps=1, local_steps=3, min_group_size=3, straggler_wait=1, allreduce_timeout=5,
                matchmaking_timeout=4)
    procs = [swarm.worker(f"w{i}", seed=i + 1, **opts) for i in range(2)]
    time.sleep(0.5)
    # SIGTERM after the first failed round: workers leave cleanly (exit 0, nothing left behind).
    swarm.wait_for(lambda: all(swarm.records(f"w{i}") for i in range(2)), 150, "a failed round", show=["w0", "w1"])
    for i in range(2):
        rec = swarm.records(f"w{i}")[0]
        assert not rec["ok"] and "need 3" in rec["reason"], rec
        os.kill(procs[i].pid, signal.SIGTERM)
    swarm.wait(procs, timeout=30)


@pytest.mark.parametrize("fault", ["lose-confirms", "freeze"])
def test_a_member_whose_round_failed_after_the_group_completed_it_ends_with_the_group(swarm, fault):
    """The victim's round of outer step 2 fails on its side after the others completed it: their CONFIRMs
    never reach it ("stream closed ... after 0 bytes" once they close), or it goes silent once its parts
    and its shard are out. It asks them, and ends with their outcome: it applies the average it holds, or
    adopts their state (frozen with every shard already in, it applies what it holds once its wait for
    the others' confirmations ends); under pace="swarm" it never carries the counted work into the next round. Every
    worker holds the same θ_global at every outer step."""
    swarm.bootstrap()
    # The others wait 3 s (verify_timeout) for the frozen victim's CONFIRM, then apply; the victim gives up on
    # its attempt after allreduce_timeout: the margin keeps that order on a busy machine.
    opts = dict(outer_steps=4, local_steps=5, step_delay=0.02, min_group_size=3, pace="swarm",
                straggler_wait=3, allreduce_timeout=15)
    if fault == "freeze":
        # With owners audited, a member silent before it answers the audit fails the round for everyone (its
        # shard cannot be checked: tests/test_audit.py); this is the settling of a round without the audit.
        opts["audit_chunks"] = 0
    procs = [swarm.worker(f"w{i}", seed=i + 1, **opts) for i in range(2)]
    procs.append(swarm.worker("victim", seed=7, fault_in_round=(2, fault), **opts))
    swarm.wait(procs, timeout=240)
    names = ["w0", "w1", "victim"]
    for name in ("w0", "w1"):
        assert sorted(ok_syncs(swarm, name)) == [1, 2, 3, 4], swarm.records(name)
        assert ok_syncs(swarm, name)[3]["group_size"] == 3  # round 2 holds the victim's contribution
    assert_hashes_agree(swarm, names, [1, 2, 3, 4])
    rounds = [r for r in swarm.records("victim") if r["before"] == 2]
    assert len(rounds) == 1, swarm.records("victim")  # one outcome for round 2: no retry without the others
    r = rounds[0]
    assert r["outer_step"] == 3 and r["global_hash"] == ok_syncs(swarm, "w0")[3]["global_hash"], r
    if r["ok"]:  # it held every shard: it applies the very average the others applied
        assert r["group_size"] == 3, r
        # Losing CONFIRMs fails its attempt, so it asks the others (settles); frozen with every shard already in
        # (the others' results can arrive before its own last frame leaves), it waits out the confirmations
        # like any member whose peers went quiet after the transfer, and applies what it holds.
        assert r["settled"] or fault == "freeze", r
    else:  # it adopted their state: its steps are not carried, they were contributed
        assert r["counted"] and not r["carried"] and "the group completed round 2" in r["reason"], r["reason"]
        assert fault == "freeze" and r["contributed"] > 0 and r["dropped"] == 0, r
    print(f"\n{fault}: the victim {'applied its held average' if r['ok'] else 'adopted the group state'}")
