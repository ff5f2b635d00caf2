"""``opendiloco doctor`` and the reachability check under it (opendiloco/swarm/ops/doctor.py, reachability.py).

The findings are judged from what peers answer (unit tests on hand-made answers); the real command
runs against a real bootstrap on 127.0.0.1 (slow); the NAT'd case runs in an emulated world
(tests/world/test_doctor_nat.py). The reachability service refuses to be used to dial anything but
the asker's own address, and answers an asker at most once per ``PER_PEER_S`` (an attacker script).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from opendiloco.swarm.connectivity.reachability import MAX_PORTS, Probe, address_kind, ip_and_port
from opendiloco.swarm.ops.doctor import Finding, judge_addresses, judge_probe, judge_reach
from opendiloco.testing.proctree import run_captured

ROOT = Path(__file__).resolve().parents[1]
PEER = "/ip4/198.51.100.7/tcp/31337/p2p/12D3KooWNRBseHA8SXNNP4ugah9vtGRJ4FdCmm6cwUJBBEgsdT33"
ME = ["/ip4/10.0.0.2/tcp/40000/p2p/12D3KooWAbc"]


def levels(findings: list[Finding]) -> list[str]:
    return [f.level for f in findings]


def answered(**kw) -> Probe:
    return Probe(peer=PEER, connect_s=0.01, rtt_s=0.08, clock_offset_s=0.01, **kw)


def test_addresses_are_told_apart():
    assert [address_kind(ip) for ip in ("127.0.0.1", "10.1.2.3", "192.168.0.9", "100.64.1.1", "fe80::1",
                                        "93.184.216.34", "2001:4860::8888", "x")] == \
        ["loopback", "private", "private", "private", "private", "public", "public", "unknown"]
    assert ip_and_port("/ip4/1.2.3.4/tcp/5/p2p/Qm") == ("1.2.3.4", 5) and ip_and_port("/ip4/1.2.3.4/udp/5") is None


def test_a_relayed_asker_is_not_dialled_back():
    from opendiloco.swarm.connectivity.reachability import direct

    assert direct("/ip4/1.2.3.4/tcp/5") and direct("/ip4/1.2.3.4/tcp/5/p2p/12D3KooWAbc")
    # Through a circuit relay the observed address is the relay's: dialling it would scan the relay's host.
    assert not direct("/ip4/1.2.3.4/tcp/5/p2p/12D3KooWRelay/p2p-circuit")
    assert not direct("/ip4/1.2.3.4/udp/5/quic") and not direct("/dns4/example.org/tcp/5")


def test_a_node_behind_nat_is_told_to_use_client_mode_or_forward_a_port():
    behind = judge_reach(answered(observed="/ip4/203.0.113.9/tcp/51234", closed_ports=[40000]), ME, False)
    assert levels(behind) == ["fail"] and "behind NAT" in behind[0].text and "203.0.113.9" in behind[0].text
    assert "client mode" in behind[0].text and "10.0.0.2" in behind[0].text
    forwarded = judge_reach(answered(observed="/ip4/203.0.113.9/tcp/51234", open_ports=[40000]), ME, False)
    assert levels(forwarded) == ["warn"] and "announce /ip4/203.0.113.9/tcp/40000" in forwarded[0].text
    client = judge_reach(answered(observed="/ip4/203.0.113.9/tcp/51234", closed_ports=[40000]), ME, True)
    assert levels(client) == ["ok"]  # in client mode it only dials out: nothing to fix


def test_a_firewall_and_a_reachable_node_are_told_apart():
    blocked = judge_reach(answered(observed="/ip4/10.0.0.2/tcp/51234", closed_ports=[40000]), ME, False)
    assert levels(blocked) == ["fail"] and "firewall" in blocked[0].text and "40000" in blocked[0].text
    fine = judge_reach(answered(observed="/ip4/10.0.0.2/tcp/51234", open_ports=[40000]), ME, False)
    assert levels(fine) == ["ok"] and "reachable" in fine[0].text
    unknown = judge_reach(answered(reach_error="StreamClosed"), ME, False)
    assert levels(unknown) == ["warn"]  # an older peer without the service: said, not failed


@pytest.mark.parametrize("offset, level", [(0.2, "ok"), (-1.5, "warn"), (2.5, "warn"), (-4.0, "fail"), (30, "fail")])
def test_a_clock_off_is_told_with_its_side(offset, level):
    found = judge_probe(Probe(peer=PEER, connect_s=0.01, rtt_s=0.08, clock_offset_s=offset,
                              observed="/ip4/10.0.0.2/tcp/1", open_ports=[40000]), ME, False)
    clock = [f for f in found if "clock" in f.text]
    assert levels(clock) == [level], found
    if level != "ok":
        assert ("behind" if offset > 0 else "ahead of") in clock[0].text and f"{abs(offset):.1f} s" in clock[0].text


def test_a_peer_that_does_not_answer_and_loopback_only_addresses_fail_with_what_to_do():
    silent = judge_probe(Probe(peer=PEER, error="nothing accepts a TCP connection at 198.51.100.7:31337"), ME, False)
    assert levels(silent) == ["fail"] and "is it running" in silent[0].text
    local = judge_addresses(["/ip4/127.0.0.1/tcp/4000/p2p/x"], [PEER], False)
    assert levels(local) == ["ok", "fail"] and "host_maddrs" in local[1].text
    assert levels(judge_addresses(["/ip4/127.0.0.1/tcp/4000/p2p/x"], ["/ip4/127.0.0.1/tcp/1/p2p/y"], False)) == ["ok"]


# -- the real command ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def bootstrap():
    from opendiloco.swarm.daemon.node import start_dht, visible_maddrs

    dht = start_dht(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        yield dht, visible_maddrs(dht)[0]
    finally:
        dht.shutdown()


def doctor(*args: str, faketime: str | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "opendiloco", "--log-level", "ERROR", "doctor", "--timeout", "5",
           "--swarm.host-maddrs", "/ip4/127.0.0.1/tcp/0", *args]
    if faketime:
        cmd = ["faketime", "-f", faketime, *cmd]
    return run_captured(cmd, cwd=ROOT, timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))


@pytest.mark.slow
def test_doctor_against_a_live_bootstrap_and_a_dead_address(bootstrap):
    _, addr = bootstrap
    peer_id = addr.rsplit("/p2p/", 1)[1]
    dead = f"/ip4/127.0.0.1/tcp/{_closed_port()}/p2p/{peer_id}"
    proc = doctor("--swarm.initial-peers", addr, dead)
    lines = proc.stdout.splitlines()
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert lines[0].startswith("ok   the p2p daemon started in") and "Traceback" not in proc.stderr
    assert any(line.startswith("ok   reachable:") for line in lines), lines
    assert any(line.startswith("ok   clocks agree") for line in lines), lines
    dead_lines = [line for line in lines if dead.split("/")[4] in line]
    assert len(dead_lines) == 1 and dead_lines[0].startswith("fail initial peer 127.0.0.1:"), lines
    assert doctor("--swarm.initial-peers", addr).returncode == 0


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("faketime") is None, reason="needs faketime (Debian's faketime package)")
def test_doctor_names_a_clock_too_far_off(bootstrap):
    _, addr = bootstrap
    proc = doctor("--swarm.initial-peers", addr, faketime="+6s")
    clock = [line for line in proc.stdout.splitlines() if "clock" in line]
    assert proc.returncode == 1 and len(clock) == 1 and clock[0].startswith("fail this machine's clock is 6."), \
        proc.stdout + proc.stderr
    assert "ahead of" in clock[0]


def _closed_port() -> int:
    from opendiloco.testing.ports import free_port

    return free_port()


# -- the service cannot be turned against anyone --------------------------------------------------

async def _attack(dht, node, target: str, ports: list[int]) -> list[dict]:
    """An attacker's script, run in its own DHT process: asks the node to dial many ports, three times."""
    from hivemind.p2p import PeerID

    from opendiloco.comm.wire import ByteStream, Code
    from opendiloco.swarm.connectivity.reachability import PROTOCOL

    peer = target.rsplit("/p2p/", 1)[1]
    answers = []
    for _ in range(3):
        _, reader, writer = await node.p2p.call_binary_stream_handler(PeerID.from_base58(peer), PROTOCOL)
        stream = ByteStream(reader, writer, remote=peer)
        await stream.send(Code.REACH, {"ports": ports})
        answers.append((await asyncio.wait_for(stream.recv(max_payload=0), 30)).meta)
        stream.close()
    return answers


@pytest.mark.slow
def test_the_reach_service_dials_only_the_asker_few_ports_and_rarely(bootstrap):
    import functools

    from opendiloco.swarm.daemon.node import start_dht

    _, addr = bootstrap
    attacker = start_dht(initial_peers=[addr], host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        ports = list(range(20000, 20100))
        answers = attacker.run_coroutine(functools.partial(_attack, target=addr, ports=ports),
                                         return_future=True).result(120)
    finally:
        attacker.shutdown()
    first, *again = answers
    assert first["observed"].startswith("/ip4/127.0.0.1/tcp/")  # the attacker's own address, as the node saw it
    assert len(first["open"]) + len(first["closed"]) == MAX_PORTS and set(first["closed"]) <= set(ports[:MAX_PORTS])
    assert all(a.get("refused") == "asked too often" and "open" not in a for a in again), again
