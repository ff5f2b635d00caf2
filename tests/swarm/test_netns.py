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
import subprocess
import sys
import time

import pytest

from opendiloco.testing.netns import Hosts, NetnsError, unavailable_reason

from .conftest import WORKER

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(90)]

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
from opendiloco.swarm.daemon.bootstrap import run_bootstrap
sys.exit(run_bootstrap(host_maddrs=[sys.argv[1]], announce_maddrs=[sys.argv[2]], addrs_file=sys.argv[3]))
"""


@pytest.fixture
def hosts():
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    h = Hosts(3, prefix=f"odlt{os.getpid()}")
    try:
        h.setup()
    except (NetnsError, OSError, subprocess.TimeoutExpired) as e:
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


SINK = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", 5001)); s.listen(); print("ready", flush=True)
c, _ = s.accept(); n = 0
while b := c.recv(1 << 20): n += len(b)
print(n, flush=True)
"""


def test_shaped_link_limits_rate_and_counters_see_the_bytes(hosts):
    """tc tbf on a host's link caps what it can send; its interface counters count every byte sent."""
    hosts.shape(0, 20)  # 20 Mbit/s: 2.5 MB take at least 1 s
    sink = subprocess.Popen(hosts.exec(1, sys.executable, "-c", SINK), stdout=subprocess.PIPE, text=True)
    try:
        assert sink.stdout.readline().strip() == "ready"
        before = hosts.counters(0)
        started = time.monotonic()
        send = f"import socket; s = socket.create_connection(({hosts.ip_of(1)!r}, 5001)); s.sendall(b'x' * 2_500_000)"
        subprocess.run(hosts.exec(0, sys.executable, "-c", send), check=True, timeout=30)
        received = int(sink.communicate(timeout=30)[0].strip())
        elapsed = time.monotonic() - started
    finally:
        if sink.poll() is None:
            sink.kill()
            sink.wait()
    sent = hosts.counters(0)["tx_bytes"] - before["tx_bytes"]
    assert received == 2_500_000
    assert 2_500_000 < sent < 2_500_000 * 1.1, sent  # payload plus TCP/IP headers
    assert elapsed > 0.8, f"2.5 MB crossed a 20 Mbit/s link in {elapsed:.2f}s"
