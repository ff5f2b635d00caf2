"""Emulated hosts on one machine, for tests and benchmarks: Linux network namespaces on a bridge.

``Hosts(n)`` creates namespaces ``<prefix>-h1..hn``, each with one veth ``eth0`` holding
``<subnet>.<i+1>/24``, plugged into a bridge that lives in a namespace of its own
(``<prefix>-sw``). Addresses exist only on interfaces created here; the machine's own network
namespace is not touched. ``shape(i, mbit)`` limits host i's link to a rate in both directions
with a token bucket (``tc tbf``: its egress on ``eth0`` and its ingress on the bridge port);
``counters(i)`` reads the bytes its ``eth0`` sent and received, i.e. what crossed the wire,
headers included.

Needs root (CAP_NET_ADMIN) and iproute2; ``unavailable_reason()`` says why not, if not.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess


class NetnsError(RuntimeError):
    """An ``ip``/``tc`` command failed."""


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(args), capture_output=True, text=True, timeout=20)
    if check and proc.returncode != 0:
        raise NetnsError(f"{' '.join(args)}: {proc.stderr.strip()}")
    return proc


def unavailable_reason() -> str | None:
    """Why namespaces cannot be created here, or None if they (probably) can."""
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    if os.geteuid() != 0:
        return "creating network namespaces needs root (CAP_NET_ADMIN)"
    return None


class Hosts:
    def __init__(self, count: int, *, subnet: str = "10.203.0", prefix: str | None = None):
        if not 1 <= count <= 250:
            raise ValueError(f"count must be within 1..250, got {count}")
        self.subnet = subnet
        self.prefix = prefix or f"odl{os.getpid()}"
        self.switch = f"{self.prefix}-sw"
        self.names = [f"{self.prefix}-h{i}" for i in range(1, count + 1)]
        self.created: list[str] = []

    def __len__(self) -> int:
        return len(self.names)

    def ip_of(self, i: int) -> str:
        return f"{self.subnet}.{i + 1}"

    def setup(self) -> Hosts:
        try:
            _run("ip", "netns", "add", self.switch)
            self.created.append(self.switch)
            _run("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
            _run("ip", "-n", self.switch, "link", "set", "br0", "up")
            for i, ns in enumerate(self.names):
                _run("ip", "netns", "add", ns)
                self.created.append(ns)
                _run("ip", "link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", f"port{i}",
                     "netns", self.switch)
                _run("ip", "-n", self.switch, "link", "set", f"port{i}", "master", "br0")
                _run("ip", "-n", self.switch, "link", "set", f"port{i}", "up")
                _run("ip", "-n", ns, "addr", "add", f"{self.ip_of(i)}/24", "dev", "eth0")
                _run("ip", "-n", ns, "link", "set", "eth0", "up")
                _run("ip", "-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.teardown()
            raise
        return self

    def teardown(self) -> list[str]:
        """Deletes every namespace created (their veths and the bridge go with them); returns errors."""
        errors = []
        for ns in reversed(self.created):
            proc = _run("ip", "netns", "del", ns, check=False)
            if proc.returncode != 0:
                errors.append(f"{ns}: {proc.stderr.strip()}")
        self.created.clear()
        return errors

    def __enter__(self) -> Hosts:
        return self.setup()

    def __exit__(self, *exc) -> None:
        errors = self.teardown()
        if errors and exc[0] is None:
            raise NetnsError(f"could not delete namespaces: {errors}")

    def exec(self, i: int, *cmd: str) -> list[str]:
        """``cmd`` run inside host i's namespace."""
        return ["ip", "netns", "exec", self.names[i], *cmd]

    def shape(self, i: int, mbit: float, *, burst_kb: int = 64, latency_ms: int = 50) -> None:
        """Limits host i's link to ``mbit`` Mbit/s each way (token bucket; no delay or loss added)."""
        if mbit <= 0:
            raise ValueError(f"rate must be positive, got {mbit}")
        tbf = ["tbf", "rate", f"{mbit}mbit", "burst", f"{burst_kb}kb", "latency", f"{latency_ms}ms"]
        _run("tc", "-n", self.names[i], "qdisc", "replace", "dev", "eth0", "root", *tbf)
        _run("tc", "-n", self.switch, "qdisc", "replace", "dev", f"port{i}", "root", *tbf)

    def counters(self, i: int) -> dict[str, int]:
        """Bytes and packets host i's ``eth0`` has sent and received so far."""
        out = _run("ip", "-n", self.names[i], "-s", "-j", "link", "show", "eth0").stdout
        stats = json.loads(out)[0]["stats64"]
        return {"tx_bytes": stats["tx"]["bytes"], "rx_bytes": stats["rx"]["bytes"],
                "tx_packets": stats["tx"]["packets"], "rx_packets": stats["rx"]["packets"]}
