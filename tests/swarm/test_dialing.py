"""The p2p daemons dial from ephemeral ports (``swarm/daemon/dialing.py``): two workers that dial each other
at once must not meet in TCP's simultaneous open on their listen ports.

Checked from the kernel's table of TCP connections: between two nodes on 127.0.0.1, no connection
joins the two listen ports (with go-libp2p's default, SO_REUSEPORT, the joiner's dial to the first
node left from its own listen port: exactly that connection)."""

from __future__ import annotations

import time

import pytest

from opendiloco.swarm.daemon.node import start_dht

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(120)]


def _established_ports() -> set[tuple[int, int]]:
    """(local port, remote port) of every established TCP connection over IPv4 on this machine."""
    out = set()
    with open("/proc/net/tcp") as table:
        next(table)
        for line in table:
            fields = line.split()
            if fields[3] == "01":  # ESTABLISHED
                out.add((int(fields[1].split(":")[1], 16), int(fields[2].split(":")[1], 16)))
    return out


def _port(dht) -> int:
    return next(int(str(m).split("/tcp/")[1].split("/")[0]) for m in dht.get_visible_maddrs()
                if str(m).startswith("/ip4/127.0.0.1/tcp/"))


def test_a_daemon_dials_from_an_ephemeral_port_not_from_the_one_it_listens_on():
    first = start_dht(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    second = start_dht(initial_peers=[str(m) for m in first.get_visible_maddrs()], host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        a, b = _port(first), _port(second)
        deadline = time.monotonic() + 60
        while not any(remote == a for _, remote in _established_ports()):
            assert time.monotonic() < deadline, "the second node never connected to the first"
            time.sleep(0.2)
        assert (a, b) not in _established_ports() and (b, a) not in _established_ports()
    finally:
        second.shutdown()
        first.shutdown()
