"""What a worker's DHT calls and its waits for peers cost in CPU, against hivemind's own way.

    python scripts/bench_dht_calls.py [--calls 400] [--seconds 10]

Calls: ``n`` calls of a trivial coroutine in the DHT process, through hivemind's ``DHT`` (an
``MPFuture`` per call, which carries a pipe end rebuilt by a socket handshake in the DHT process)
and through ``WorkerBoundDHT`` (``swarm/daemon/dht_calls.py``: answered by number on one pipe); CPU of the
caller and its DHT process per call, and wall time per call. Waiting: a run of two workers and a
bootstrap on 127.0.0.1 in which one worker waits in matchmaking for the other, which never comes;
the cores all their processes (Python, DHT processes, p2pd) use, with the matchmaker looking every
``poll_interval`` (20 ms) throughout against the gap that doubles up to ``quiet_poll_interval``
while nothing changes; and the cores of that run between rounds. Each figure is printed as a ratio
of its baseline, measured in the same run.
"""

from __future__ import annotations

import argparse
import os
import time

import hivemind
import torch

from opendiloco.comm.base import RoundKey
from opendiloco.swarm.communicator import SwarmCommunicator
from opendiloco.swarm.daemon.node import start_dht
from opendiloco.swarm.settings import SwarmSettings

LOCAL = ["/ip4/127.0.0.1/tcp/0"]
HZ = os.sysconf("SC_CLK_TCK")


def _processes() -> dict[int, tuple[int, float]]:
    """Every process: (parent, CPU seconds so far)."""
    out = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    rest = f.read().rsplit(")", 1)[1].split()
                out[int(entry)] = (int(rest[1]), (int(rest[11]) + int(rest[12])) / HZ)
            except (OSError, ValueError, IndexError):
                pass
    return out


def tree_cpu() -> float:
    """CPU seconds of this process and its descendants (DHT processes and their p2pd)."""
    procs, me = _processes(), os.getpid()
    mine, grew = {me}, True
    while grew:
        grew = False
        for pid, (parent, _) in procs.items():
            if parent in mine and pid not in mine:
                mine.add(pid)
                grew = True
    return sum(procs[p][1] for p in mine if p in procs)


async def nothing(dht, node):
    return None


def per_call(dht, n: int) -> tuple[float, float]:
    """(CPU ms, wall ms) per call of ``nothing``."""
    for _ in range(20):
        dht.run_coroutine(nothing)
    c0, t0 = tree_cpu(), time.perf_counter()
    for _ in range(n):
        dht.run_coroutine(nothing)
    return 1e3 * (tree_cpu() - c0) / n, 1e3 * (time.perf_counter() - t0) / n


def waiting_cores(quiet_poll_interval: float, seconds: float, idle: list | None = None) -> float:
    """Cores of a run of two and its bootstrap while one worker waits in matchmaking; ``idle`` gets the
    cores of the same run before the wait (both workers between rounds)."""
    settings = SwarmSettings(run_id="bench", min_group_size=2, straggler_wait=3 * seconds,
                             matchmaking_timeout=3 * seconds, heartbeat_interval=2.0, record_ttl=8.0,
                             poll_interval=0.02, quiet_poll_interval=quiet_poll_interval)
    first = start_dht(host_maddrs=LOCAL)
    peers = [str(m) for m in first.get_visible_maddrs()]
    waiting = SwarmCommunicator(start_dht(initial_peers=peers, host_maddrs=LOCAL), settings)
    other = SwarmCommunicator(start_dht(initial_peers=peers, host_maddrs=LOCAL), settings)
    try:
        while len(waiting.live_workers()) < 2:
            time.sleep(0.2)
        if idle is not None:
            c0, t0 = tree_cpu(), time.monotonic()
            time.sleep(seconds)
            idle.append((tree_cpu() - c0) / (time.monotonic() - t0))
        work = waiting.start(torch.zeros(64), weight=1.0, key=RoundKey(0))
        time.sleep(2.0)  # past the first looks
        c0, t0 = tree_cpu(), time.monotonic()
        time.sleep(seconds)
        cores = (tree_cpu() - c0) / (time.monotonic() - t0)
        waiting.interrupt()
        try:
            work.wait(30)
        except Exception:  # interrupted: what we asked for
            pass
        return cores
    finally:
        waiting.close()
        other.close()
        first.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=400)
    p.add_argument("--seconds", type=float, default=10.0)
    args = p.parse_args()

    plain = hivemind.DHT(start=True, host_maddrs=LOCAL)
    ours = start_dht(host_maddrs=LOCAL)
    try:
        base_cpu, base_wall = per_call(plain, args.calls)
        cpu, wall = per_call(ours, args.calls)
    finally:
        plain.shutdown()
        ours.shutdown()
    print(f"DHT call, hivemind's MPFuture: {base_cpu:.2f} ms CPU, {base_wall:.2f} ms wall (baseline)")
    print(f"DHT call, answered by number:  {cpu:.2f} ms CPU ({cpu / base_cpu:.2f}x), "
          f"{wall:.2f} ms wall ({wall / base_wall:.2f}x)")
    idle: list[float] = []
    fixed = waiting_cores(0.02, args.seconds)
    backoff = waiting_cores(SwarmSettings.quiet_poll_interval, args.seconds, idle)
    print(f"a run of 2 between rounds (heartbeat {SwarmSettings.heartbeat_interval} s): {idle[0]:.3f} cores")
    print(f"a run of 2 with one worker waiting, a look every 20 ms: {fixed:.3f} cores (baseline)")
    print(f"the same, the gap doubling to {SwarmSettings.quiet_poll_interval} s: {backoff:.3f} cores "
          f"({backoff / fixed:.2f}x)")


if __name__ == "__main__":
    main()
