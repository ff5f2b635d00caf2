"""A swarm across network namespaces: three hosts with their own IPs on a private test subnet.

Each node runs in its own Linux network namespace, wired to a bridge that lives in a fourth
namespace, on 10.203.0.0/24: addresses exist only on interfaces this test creates, and the
host's own network namespace is not touched. This checks what 127.0.0.1 tests cannot: that a
node listening on 0.0.0.0 and announcing ``/ip4/<its IP>/tcp/31337`` is reached by peers on
other hosts, that the same port works on every host, and that workers joining through the
bootstrap's *announced* address find each other and average together.

Needs root (``ip netns add``) and iproute2; skipped with the reason otherwise.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import pytest

from .conftest import WORKER

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(90)]

SUBNET = "10.203.0"
PORT = 31337

# tests/swarm/worker.py listens on 127.0.0.1; this wrapper runs it unchanged with another
# host/announce address: python -c WRAPPER HOST_MADDR ANNOUNCE_MADDR <worker.py options>.
# It starts with the bootstrap (imports take most of the time) and waits for its peers file.
WRAPPER = f"""
import importlib.util, os, sys, time
spec = importlib.util.spec_from_file_location("swarm_worker", {str(WORKER)!r})
worker = importlib.util.module_from_spec(spec)
spec.loader.exec_module(worker)
host, announce = sys.argv[1], sys.argv[2]
start_dht = worker.start_dht
def bound(**kwargs):
    kwargs.update(host_maddrs=[host], announce_maddrs=[announce])
    return start_dht(**kwargs)
worker.start_dht = bound
sys.argv = [{str(WORKER)!r}] + sys.argv[3:]
peers_file = sys.argv[sys.argv.index("--peers-file") + 1]
deadline = time.monotonic() + 60
while not (os.path.exists(peers_file) and open(peers_file).read().strip()) and time.monotonic() < deadline:
    time.sleep(0.1)
sys.exit(worker.main())
"""

BOOTSTRAP = """
import sys
from opendiloco.swarm.bootstrap import run_bootstrap
sys.exit(run_bootstrap(host_maddrs=[sys.argv[1]], announce_maddrs=[sys.argv[2]], addrs_file=sys.argv[3]))
"""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20)
    if check and proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {proc.stderr.strip()}")
    return proc


class Hosts:
    """Namespaces ``<prefix>-h1..hN`` with 10.203.0.<i>/24 on a veth, bridged in ``<prefix>-sw``."""

    def __init__(self, count: int):
        self.prefix = f"odl{os.getpid()}"
        self.switch = f"{self.prefix}-sw"
        self.names = [f"{self.prefix}-h{i}" for i in range(1, count + 1)]
        self.created: list[str] = []

    def ip_of(self, i: int) -> str:
        return f"{SUBNET}.{i + 1}"

    def setup(self) -> None:
        _ip("netns", "add", self.switch)
        self.created.append(self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for i, ns in enumerate(self.names):
            _ip("netns", "add", ns)
            self.created.append(ns)
            _ip("link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", f"port{i}", "netns", self.switch)
            _ip("-n", self.switch, "link", "set", f"port{i}", "master", "br0")
            _ip("-n", self.switch, "link", "set", f"port{i}", "up")
            _ip("-n", ns, "addr", "add", f"{self.ip_of(i)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")

    def teardown(self) -> list[str]:
        errors = []
        for ns in reversed(self.created):  # deleting a namespace destroys its veth ends and bridge
            proc = _ip("netns", "del", ns, check=False)
            if proc.returncode != 0:
                errors.append(f"{ns}: {proc.stderr.strip()}")
        self.created.clear()
        return errors

    def exec(self, i: int, *cmd: str) -> list[str]:
        return ["ip", "netns", "exec", self.names[i], *cmd]


@pytest.fixture
def hosts():
    if shutil.which("ip") is None:
        pytest.skip("iproute2's `ip` is not installed: cannot create network namespaces")
    if os.geteuid() != 0:
        pytest.skip("creating network namespaces needs root (CAP_NET_ADMIN)")
    h = Hosts(3)
    try:
        h.setup()
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
        h.teardown()
        pytest.skip(f"network namespaces are not permitted here: {e}")
    try:
        yield h
    finally:
        errors = h.teardown()
        assert not errors, f"could not delete test namespaces: {errors}"


def _wait_for_file(path, proc, swarm, name, timeout=45.0) -> str:
    deadline = time.monotonic() + timeout
    while not (path.exists() and path.read_text().strip()):
        assert proc.poll() is None, f"{name} exited:\n{swarm.log(name)}"
        assert time.monotonic() < deadline, f"{name} wrote no {path.name} in time:\n{swarm.log(name)}"
        time.sleep(0.1)
    return path.read_text()


def test_workers_on_three_hosts_join_by_announced_address_and_agree(hosts, swarm):
    # `hosts` is set up before `swarm`, so it is torn down after every process is gone.
    bootstrap_ip = hosts.ip_of(0)
    proc = swarm.spawn(hosts.exec(0, sys.executable, "-c", BOOTSTRAP, f"/ip4/0.0.0.0/tcp/{PORT}",
                                  f"/ip4/{bootstrap_ip}/tcp/{PORT}", str(swarm.peers_file)), "bootstrap")
    names = ["w1", "w2"]
    procs = []
    for i, name in enumerate(names, start=1):
        args = [sys.executable, "-c", WRAPPER, f"/ip4/0.0.0.0/tcp/{PORT}", f"/ip4/{hosts.ip_of(i)}/tcp/{PORT}",
                "--peers-file", str(swarm.peers_file), "--out", str(swarm.out(name)), "--seed", str(i),
                "--outer-steps", "2", "--local-steps", "4", "--min-group-size", "2", "--straggler-wait", "5",
                "--allreduce-timeout", "15"]
        procs.append(swarm.spawn(hosts.exec(i, *args), name))
    addrs = _wait_for_file(swarm.peers_file, proc, swarm, "bootstrap").split()
    assert len(addrs) == 1 and addrs[0].startswith(f"/ip4/{bootstrap_ip}/tcp/{PORT}/p2p/12D3KooW"), addrs
    swarm.wait(procs, timeout=70)

    peer_ids = {name: swarm.records(name, "start")[0]["peer_id"] for name in names}
    syncs = {name: {r["outer_step"]: r for r in swarm.records(name) if r["ok"]} for name in names}
    for name in names:
        assert sorted(syncs[name]) == [1, 2], f"{name}: {swarm.records(name)}\n{swarm.log(name)}"
    for step in (1, 2):
        for name in names:
            assert syncs[name][step]["group_size"] == 2
            assert set(syncs[name][step]["peers"]) == set(peer_ids.values())
        hashes = {syncs[name][step]["global_hash"] for name in names}
        assert len(hashes) == 1, f"outer step {step}: replicas disagree: {hashes}"
