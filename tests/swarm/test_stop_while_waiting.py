"""SIGTERM to an `opendiloco train` worker that waits for a frozen peer: it leaves at once, not when the wait ends.

Two pairs of CLI workers (two runs on one bootstrap) train with every wait set to ``WAIT`` seconds.
In one pair a peer freezes (its whole process tree, as a host that vanished) before its round, so the
other waits for it in matchmaking; in the other the peer freezes after it announced its round, so the
other, which leads the group, waits for it in the exchange (up to ``allreduce_timeout``). Each waiting
worker gets SIGTERM and must exit 0 with its checkpoint long before ``WAIT`` (half of it, so that
a slow or loaded machine does not matter).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from opendiloco.comm.base import RoundKey
from opendiloco.swarm.daemon.node import ensure_identity, start_dht
from opendiloco.swarm.membership import Membership
from opendiloco.swarm.records import RunRecords
from opendiloco.swarm.signing import Identity
from opendiloco.testing.proctree import descendants
from tests.test_train_loop import SMALL

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(420)]

WAIT = 240.0
"""straggler_wait, max_wait, matchmaking_timeout and allreduce_timeout of every worker."""
SLOW = 1.0
"""Seconds per inner step of each pair's slower worker (local_steps 4: a round every 4 s or so)."""


def _metrics(run_dir) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _rounds(run_dir) -> list[dict]:
    return [r for r in _metrics(run_dir) if r["event"] == "outer_step" and r["ok"]]


def _since_sigterm(swarm, name: str) -> str:
    log = swarm.log(name, 1_000_000)
    assert "SIGTERM received" in log, log
    return log[log.index("SIGTERM received"):]


def _freeze(pids: list[int], frozen: list[int]) -> None:
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
        frozen.append(pid)


def _stop_and_time(swarm, proc, run_dir) -> float:
    name = proc.name
    assert proc.poll() is None, swarm.log(name)
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(WAIT / 2)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{name} still running {WAIT / 2:.0f}s after SIGTERM (it waits for its frozen peer):\n"
                    f"{swarm.log(name)}")
    took = time.monotonic() - sent
    assert proc.returncode == 0, swarm.log(name)
    assert (run_dir / "checkpoints" / "latest").is_file(), swarm.log(name)
    end = _metrics(run_dir)[-1]
    assert end["event"] == "end" and end["stopped"] is True, end
    return took


class _GroupsLed:
    """Reads, from the DHT as any peer of an open run can, the rounds for which ``leader`` has
    published a group: a leader publishes its group just before it sends its part to the members."""

    def __init__(self, peers: list[str], run_id: str, leader: str):
        self.dht = start_dht(initial_peers=peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        self.book = RunRecords(self.dht, Membership.open(run_id))
        self.leader = leader

    def published(self, events) -> bool:
        return any(self.leader in self.book.subkey_values(self.book.group_key(RoundKey(event), 0), 3600)
                   for event in events)

    def announced(self, peer: str, events) -> bool:
        """Whether ``peer`` has announced itself ready for one of these rounds (it is in matchmaking)."""
        return any(peer in self.book.subkey_values(self.book.round_key(RoundKey(event)), 3600) for event in events)

    def close(self) -> None:
        self.dht.shutdown()


def test_sigterm_abandons_matchmaking_and_exchange_with_a_frozen_peer(swarm, tmp_path):
    peers = swarm.bootstrap()
    procs = {}
    # Peer ids decide who leads a group (the smallest): the exchange pair's waiting worker must lead,
    # so that it publishes the group with its frozen peer and enters the exchange.
    ids = []
    for i in range(2):
        path = str(tmp_path / f"identity{i}.key")
        ensure_identity(path)
        ids.append((Identity.from_file(path).peer_id, path))
    ids.sort()
    waits = [f"--swarm.{k}" for k in ("straggler-wait", "max-wait", "matchmaking-timeout", "allreduce-timeout")]
    dirs = {}
    # (name, run, throttle, identity): "wait_*" is the worker that will wait, "peer_*" the one that freezes.
    workers = [("wait_mm", "mm", 0.0, None), ("peer_mm", "mm", SLOW, None),
               ("wait_x", "x", SLOW, ids[0][1]), ("peer_x", "x", 0.0, ids[1][1])]
    for name, run, throttle, identity in workers:
        dirs[name] = tmp_path / name
        args = [sys.executable, "-m", "opendiloco", "train", *SMALL, "--run.dir", str(dirs[name]), "--run.worker", name,
                "--train.total-steps", "1000", "--train.throttle", str(throttle), "--optim.pace", "fixed",
                "--checkpoint.every-outer-steps", "0", "--swarm.run-id", run, "--swarm.initial-peers", *peers,
                "--swarm.open", "--swarm.host-maddrs", "/ip4/127.0.0.1/tcp/0", "--swarm.min-group-size", "2",
                "--swarm.join-timeout", "1", *[a for k in waits for a in (k, str(WAIT))]]
        if identity:
            args += ["--swarm.identity-path", identity]
        procs[name] = swarm.spawn(args, name)
    names = list(dirs)
    swarm.wait_for(lambda: all(_rounds(dirs[n]) for n in names), 150, "a first round in both runs",
                   [procs[n] for n in names])

    def fresh_round(run: str) -> None:
        """Returns just after the pair of ``run`` has completed a round."""
        done = len(_rounds(dirs[f"wait_{run}"]))
        swarm.wait_for(lambda: len(_rounds(dirs[f"wait_{run}"])) > done, 60, f"a fresh round in run {run}",
                       [procs[f"wait_{run}"], procs[f"peer_{run}"]])

    frozen: list[int] = []
    try:
        # Matchmaking: wait_mm (no throttle) enters its next round at once and waits there for peer_mm,
        # which freezes, process tree and all, before it gets there.
        fresh_round("mm")
        time.sleep(SLOW)
        peer = procs["peer_mm"].pid
        _freeze([peer, *descendants(peer)], frozen)
        time.sleep(2.0)
        took_mm = _stop_and_time(swarm, procs["wait_mm"], dirs["wait_mm"])
        log = _since_sigterm(swarm, "wait_mm")
        assert "the worker is stopping" in log and "peers failed" not in log, log  # it left in matchmaking

        # Exchange: peer_x (no throttle) announces its next round at once and freezes there; wait_x,
        # a few seconds later, publishes their group (seen here in the DHT) and sends to it, then waits
        # for its answer. What this test reads can lag behind the run on a busy machine (the pair may have
        # done that round before peer_x froze): then peer_x is thawed and the next round is tried.
        groups = _GroupsLed(peers, "x", ids[0][0])
        try:
            for _ in range(3):
                fresh_round("x")
                rounds = len(_rounds(dirs["wait_x"]))
                swarm.wait_for(lambda n=rounds: len(_rounds(dirs["peer_x"])) >= n, 30, "peer_x's record of the round",
                               [procs["peer_x"]])
                # (A round that reached outer step n had event n - 1; the next one is event n.)
                upcoming = [_rounds(dirs["wait_x"])[-1]["outer_step"]]
                swarm.wait_for(lambda u=upcoming: groups.announced(ids[1][0], u), 60, "peer_x's announcement",
                               [procs["peer_x"]])
                _freeze([procs["peer_x"].pid], frozen)
                # wait_x publishes that round's group (with the frozen peer_x) and then sends to it: the exchange.
                swarm.wait_for(lambda u=upcoming: groups.published(u), 120, "wait_x's next group", [procs["wait_x"]])
                time.sleep(3.0)
                if _rounds(dirs["wait_x"])[-1]["outer_step"] == upcoming[0]:
                    break  # wait_x has not completed that round: it waits for peer_x in its exchange
                os.kill(frozen.pop(), signal.SIGCONT)
            else:
                pytest.fail("the pair's rounds always ended before peer_x froze:\n" + swarm.log("wait_x"))
        finally:
            groups.close()
        took_x = _stop_and_time(swarm, procs["wait_x"], dirs["wait_x"])
        log = _since_sigterm(swarm, "wait_x")
        assert "2 peers failed: the worker is stopping" in log, swarm.log("wait_x")  # it left mid exchange
    finally:
        for pid in frozen:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
    print(f"SIGTERM to exit: {took_mm:.1f}s in matchmaking, {took_x:.1f}s in the exchange (waits of {WAIT:.0f}s)")
