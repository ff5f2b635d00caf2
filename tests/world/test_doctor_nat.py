"""``opendiloco doctor`` in an emulated world: a node behind a masquerading router is told it is behind
NAT and what to do; the same node in client mode, and a public node, are told they are fine.

Needs root, iproute2 and iptables (skipped with the reason otherwise).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from opendiloco.testing.proctree import ProcessGroup, run_captured
from opendiloco.testing.world import LinkSpec, World, WorldError, unavailable_reason

pytestmark = [pytest.mark.world, pytest.mark.timeout(300)]
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    w = World({("a", "a"): LinkSpec(delay_ms=5)}, prefix=f"oddr{os.getpid() % 10000}", seed=0)
    for name, nat in (("boot", False), ("pub", False), ("home", True)):
        w.add_host(name, "a", nat=nat)
    try:
        w.setup()
    except (WorldError, OSError, subprocess.TimeoutExpired) as e:
        pytest.skip(f"cannot build a world here: {e}")
    workdir = tmp_path_factory.mktemp("doctor")
    addrs = workdir / "addrs"
    group = ProcessGroup(workdir / "logs", cwd=ROOT)
    boot = group.spawn(w.exec("boot", sys.executable, "-m", "opendiloco", "dht", "--host-maddrs",
                              "/ip4/0.0.0.0/tcp/31337", "--addrs-file", str(addrs)), "boot")
    try:
        deadline = time.monotonic() + 120
        while not addrs.exists():
            assert boot.poll() is None, group.log("boot")
            assert time.monotonic() < deadline, "the bootstrap did not start"
            time.sleep(0.2)
        peer = next(a for a in addrs.read_text().split() if f"/ip4/{w.ip_of('boot')}/" in a)
        yield w, peer
    finally:
        group.stop(grace=20)
        deadline = time.monotonic() + 20  # its DHT process and p2p daemon follow it out
        while _pids(w.netns("boot")) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not w.teardown()


def _pids(netns: str) -> list[str]:
    return subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True, timeout=20).stdout.split()


def doctor(w: World, host: str, peer: str, *extra: str) -> subprocess.CompletedProcess:
    cmd = w.exec(host, sys.executable, "-m", "opendiloco", "--log-level", "ERROR", "doctor", "--timeout", "10",
                 "--swarm.initial-peers", peer, "--swarm.host-maddrs", "/ip4/0.0.0.0/tcp/0", *extra)
    return run_captured(cmd, cwd=ROOT, timeout=180)


def test_a_node_behind_nat_is_told_so_and_what_to_do(world):
    w, peer = world
    proc = doctor(w, "home", peer)
    fails = [line for line in proc.stdout.splitlines() if line.startswith("fail")]
    assert proc.returncode == 1 and len(fails) == 1, proc.stdout + proc.stderr
    assert "behind NAT" in fails[0] and w.ip_of("home") in fails[0] and w.private_ip_of("home") in fails[0]
    assert "client mode" in fails[0]
    assert any(line.startswith("ok   initial peer") for line in proc.stdout.splitlines())


def test_client_mode_behind_nat_and_a_public_node_are_fine(world):
    w, peer = world
    client = doctor(w, "home", peer, "--swarm.client-mode", "true")
    assert client.returncode == 0, client.stdout + client.stderr
    assert any("client mode" in line and line.startswith("ok") for line in client.stdout.splitlines())
    public = doctor(w, "pub", peer)
    assert public.returncode == 0, public.stdout + public.stderr
    assert any(line.startswith("ok   reachable: ") and w.ip_of("pub") in line for line in public.stdout.splitlines())
