"""announce_maddrs: a node advertises exactly the addresses it is told to, and peers use them.

On 127.0.0.1 the "public" address of a node behind a port mapping is imitated with 127.0.0.2
(the whole 127/8 reaches loopback on Linux): the node listens on 0.0.0.0:PORT and announces
only /ip4/127.0.0.2/tcp/PORT, an address it does not list among its own listen addresses.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from hivemind.utils.timed_storage import get_dht_time

from opendiloco.swarm.daemon.node import SwarmError, start_dht, visible_maddrs
from opendiloco.swarm.membership import Membership
from opendiloco.swarm.records import RunRecords
from opendiloco.testing.ports import free_port
from opendiloco.testing.proctree import descendants, still_running

from .conftest import ROOT

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(60)]


async def _connected_peers(dht, node) -> dict[str, list[str]]:
    """Runs inside the DHT process: the peers its p2p daemon is connected to, with their addresses."""
    return {info.peer_id.to_base58(): [str(a) for a in info.addrs] for info in await node.p2p.list_peers()}


@pytest.fixture
def dhts():
    """Collects DHT nodes started in this process; shuts them down and checks nothing is left running."""
    started = []
    before = set(descendants(os.getpid()))
    yield started
    for dht in started:
        dht.shutdown()
    left = still_running(set(descendants(os.getpid())) - before)
    assert not left, f"DHT processes or p2pd left running: {left}"


def test_node_advertises_exactly_its_announce_maddrs_and_peers_reach_it_there(dhts):
    port = free_port("0.0.0.0")
    announced = f"/ip4/127.0.0.2/tcp/{port}"
    node = start_dht(host_maddrs=[f"/ip4/0.0.0.0/tcp/{port}"], announce_maddrs=[announced])
    dhts.append(node)
    node_id = node.peer_id.to_base58()

    assert visible_maddrs(node) == [f"{announced}/p2p/{node_id}"]
    assert [str(m) for m in node.get_visible_maddrs()] == [f"{announced}/p2p/{node_id}"]

    # Another peer joins through the announced address only, and is connected to it there.
    other = start_dht(initial_peers=visible_maddrs(node), host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    dhts.append(other)
    seen = other.run_coroutine(_connected_peers)
    assert node_id in seen, seen
    assert seen[node_id] == [announced], seen[node_id]

    # And the DHT works over that connection in both directions (with signed records, the only kind
    # our nodes store: an unsigned one is refused).
    assert not other.store("announce-test-0", "unsigned", expiration_time=get_dht_time() + 30)
    from_other = RunRecords(other, Membership.open("announce"), other.identity)
    from_node = RunRecords(node, Membership.open("announce"), node.identity)
    from_other.store("announce-test", "from-other", get_dht_time() + 30)
    assert from_node.subkey_values("announce-test", 60) == {other.identity.peer_id: "from-other"}
    from_node.store("announce-test-2", "from-node", get_dht_time() + 30)
    assert from_other.subkey_values("announce-test-2", 60) == {node_id: "from-node"}


def test_several_announce_maddrs_including_dns_are_all_advertised(dhts):
    port = free_port("0.0.0.0")
    announced = [f"/dns4/localhost/tcp/{port}", f"/ip4/127.0.0.2/tcp/{port}"]
    node = start_dht(host_maddrs=[f"/ip4/0.0.0.0/tcp/{port}"], announce_maddrs=announced)
    dhts.append(node)
    node_id = node.peer_id.to_base58()
    assert sorted(visible_maddrs(node)) == sorted(f"{a}/p2p/{node_id}" for a in announced)

    # A peer given only the DNS name (as compose workers are: /dns4/bootstrap/...) joins.
    dns_addr = f"/dns4/localhost/tcp/{port}/p2p/{node_id}"
    other = start_dht(initial_peers=[dns_addr], host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    dhts.append(other)
    assert node_id in other.run_coroutine(_connected_peers)


def test_without_announce_maddrs_a_node_advertises_where_it_listens(dhts):
    node = start_dht(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    dhts.append(node)
    addrs = visible_maddrs(node)
    assert len(addrs) == 1 and addrs[0].startswith("/ip4/127.0.0.1/tcp/"), addrs
    assert not addrs[0].startswith("/ip4/127.0.0.1/tcp/0/"), addrs


@pytest.mark.parametrize("addr", ["/ip4/203.0.113.5/tcp/0", "/ip4/203.0.113.5/udp/0/quic-v1",
                                  "/dns4/example.org/tcp/0"])
def test_port_zero_in_announce_maddrs_is_refused_clearly(addr):
    started = time.monotonic()
    with pytest.raises(SwarmError, match="port 0") as err:
        start_dht(host_maddrs=["/ip4/127.0.0.1/tcp/0"], announce_maddrs=[addr])
    assert addr in str(err.value) and "announce" in str(err.value)
    assert time.monotonic() - started < 2, "refused only after starting a node"


def test_cli_dht_refuses_port_zero_in_announce_maddrs(tmp_path):
    """`opendiloco dht --announce-maddrs .../tcp/0` fails at once with the same message."""
    cmd = [sys.executable, "-m", "opendiloco.cli", "dht", "--host-maddrs", "/ip4/127.0.0.1/tcp/0",
           "--announce-maddrs", "/ip4/203.0.113.5/tcp/0", "--addrs-file", str(tmp_path / "addrs")]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=40)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
    if "invalid choice: 'dht'" in out:
        pytest.skip("the `opendiloco dht` subcommand is not there yet")
    assert proc.returncode != 0, out
    assert "port 0" in out, out
    assert "Traceback" not in out, out
    assert not (tmp_path / "addrs").exists()
