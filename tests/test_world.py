"""The emulated world: link delay, loss and rate, partitions, NAT, readdressing, and cleanup.

One world for most tests (regions a and b; a1, a2, b1, b2 public, n1 behind a NAT router in
a), with a probe server (``opendiloco/testing/probes.py``) on every host; each test sets the
links it needs. Assertions are behaviour or lower bounds, never a machine's speed: a frame is
never delivered before its configured delay, a rate-limited transfer cannot beat size/rate.

Needs root, iproute2, /dev/net/tun and iptables (skipped with the reason otherwise).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from opendiloco.testing import probes
from opendiloco.testing.proctree import alive
from opendiloco.testing.world import LinkSpec, World, WorldError, cleanup_stale, unavailable_reason

pytestmark = [pytest.mark.world, pytest.mark.timeout(120)]

PORT = "5001"
ROOT = Path(__file__).resolve().parents[1]
HOSTS = [("a1", "a", False), ("a2", "a", False), ("b1", "b", False), ("b2", "b", False), ("n1", "a", True)]
PLAIN = {("a", "a"): LinkSpec(), ("b", "b"): LinkSpec(), ("a", "b"): LinkSpec()}


def _namespaces(prefix: str) -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=20).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(f"{prefix}-")]


def _skip_unless_available() -> None:
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)


@pytest.fixture(scope="module")
def world():
    _skip_unless_available()
    w = World(PLAIN, prefix=f"odwt{os.getpid()}", seed=0)
    for name, region, nat in HOSTS:
        w.add_host(name, region, nat=nat)
    try:
        w.setup()
    except (WorldError, OSError, subprocess.TimeoutExpired) as e:
        pytest.skip(f"cannot build a world here: {e}")
    servers = []
    try:
        for name, _, _ in HOSTS:
            proc = subprocess.Popen(w.exec(name, *probes.command("serve", "--port", PORT, "--timeout", "300")),
                                    stdout=subprocess.PIPE, text=True)
            servers.append(proc)
        for proc in servers:
            assert '"ready"' in proc.stdout.readline()
        yield w
    finally:
        for proc in servers:
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)
        errors = w.teardown()
        assert not errors, errors
        assert not _namespaces(w.prefix)


@pytest.fixture
def links(world):
    """Plain links again after each test (and no partition)."""
    yield world
    world.heal()
    for (a, b), spec in PLAIN.items():
        world.set_link(a, b, spec)
    for name, _, _ in HOSTS:
        world.reconnect(name)


def probe(world: World, host: str, *args: str, timeout: float = 30.0) -> dict:
    proc = subprocess.run(world.exec(host, *probes.command(*args)), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def connect(world: World, src: str, ip: str, timeout: float = 1.0) -> dict:
    return probe(world, src, "connect", ip, PORT, "--timeout", str(timeout))


def rtts(world: World, src: str, dst: str, count: int = 8) -> list[float]:
    out = probe(world, src, "rtt", world.ip_of(dst), PORT, "--count", str(count), "--timeout", "2")
    assert out["rtts_ms"], out
    return out["rtts_ms"]


def test_delay_bounds_the_rtt_between_regions_and_not_inside_one(links):
    w = links
    w.set_link("a", "b", LinkSpec(delay_ms=30, jitter_ms=5))
    between = rtts(w, "a1", "b1")
    inside = rtts(w, "a1", "a2")
    assert min(between) >= 2 * (30 - 5), between  # never delivered before delay - jitter, each way
    assert min(inside) < 25, inside  # no delay inside a region: far below the cross-region floor
    w.set_link("a", "b", LinkSpec(delay_ms=60))  # live: the next frames take the new delay
    assert min(rtts(w, "a1", "b1", count=3)) >= 120


def test_loss_drops_about_the_configured_share_of_datagrams(links):
    w = links
    w.set_link("a", "b", LinkSpec(loss=0.2))
    before = w.stats()["links"]["a|b"]["dropped_loss"]
    out = probe(w, "a1", "udp", w.ip_of("b1"), PORT, "--count", "400", "--interval", "0.001")
    lost = 1 - out["received"] / out["sent"]
    assert 0.05 <= lost <= 0.40, out
    assert w.stats()["links"]["a|b"]["dropped_loss"] - before >= out["sent"] - out["received"]
    inside = probe(w, "a1", "udp", w.ip_of("a2"), PORT, "--count", "100", "--interval", "0.001")
    assert inside["received"] >= 0.9 * inside["sent"], inside  # no loss configured inside region a


def test_rate_limits_a_bulk_transfer(links):
    w = links
    w.set_link("a", "b", LinkSpec(rate_mbit=10))
    size = 1_250_000  # 1 s at 10 Mbit/s (frames carry headers too: more than that)
    out = probe(w, "a1", "send", w.ip_of("b1"), PORT, "--bytes", str(size))
    assert out["server"]["bytes"] == size
    assert out["server"]["seconds"] >= 0.9 * size * 8 / 10e6, out  # 10%: the bucket's one-frame burst


def test_rate_belongs_to_the_receivers_access_link_too(links):
    """Two senders of region a to one host of b share b1's 10 Mbit/s from a: not 10 each."""
    w = links
    w.set_link("a", "b", LinkSpec(rate_mbit=10))
    size = 600_000
    argv = [w.exec(src, *probes.command("send", w.ip_of("b1"), PORT, "--bytes", str(size))) for src in ("a1", "a2")]
    procs = [subprocess.Popen(a, stdout=subprocess.PIPE, text=True) for a in argv]
    try:
        outs = [json.loads(p.communicate(timeout=30)[0].strip().splitlines()[-1]) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    span = max(o["server"]["last"] for o in outs) - min(o["server"]["first"] for o in outs)
    assert span >= 0.9 * 2 * size * 8 / 10e6, outs


def test_partition_blocks_and_heal_restores(links):
    w = links
    assert connect(w, "a1", w.ip_of("b1"))["ok"]
    w.partition({"a"}, {"b"})
    assert not connect(w, "a1", w.ip_of("b1"))["ok"]
    assert not connect(w, "b2", w.ip_of("a2"))["ok"]
    assert connect(w, "a1", w.ip_of("a2"))["ok"]  # inside a group: unaffected
    assert w.stats()["links"]["a|b"]["dropped_partition"] > 0
    w.heal()
    assert connect(w, "a1", w.ip_of("b1"), timeout=5)["ok"]
    w.partition({"b"})  # the regions not named form the other group
    assert not connect(w, "a1", w.ip_of("b1"))["ok"]
    w.heal()
    w.disconnect("b1")  # one host's cable pulled
    assert not connect(w, "b2", w.ip_of("b1"))["ok"]
    w.reconnect("b1")
    assert connect(w, "b2", w.ip_of("b1"), timeout=5)["ok"]


def test_nat_lets_connections_out_and_nothing_new_in(links):
    w = links
    assert w.ip_of("n1") != w.private_ip_of("n1")
    out = connect(w, "n1", w.ip_of("b1"), timeout=5)
    assert out["ok"] and out["peer"] == w.ip_of("n1"), out  # masqueraded: b1 sees the router
    assert connect(w, "n1", w.ip_of("a1"), timeout=5)["ok"]
    assert not connect(w, "b1", w.ip_of("n1"))["ok"]  # the router drops what is new from outside
    assert not connect(w, "a1", w.private_ip_of("n1"))["ok"]  # private addresses are not routed


def test_readdress_moves_a_host_and_a_nat_router(links):
    w = links
    old = w.ip_of("b2")
    assert connect(w, "a1", old, timeout=5)["ok"]
    new = w.readdress("b2")
    assert new != old and w.ip_of("b2") == new == w.private_ip_of("b2")
    assert not connect(w, "a1", old)["ok"]
    assert connect(w, "a1", new, timeout=5)["ok"]

    old = w.ip_of("n1")
    private = w.private_ip_of("n1")
    new = w.readdress("n1")
    assert new != old and w.private_ip_of("n1") == private
    out = connect(w, "n1", w.ip_of("b1"), timeout=5)
    assert out["ok"] and out["peer"] == new, out


def test_counters_and_stats_see_the_traffic(links):
    w = links
    before = w.counters("a1")
    probe(w, "a1", "send", w.ip_of("a2"), PORT, "--bytes", "2000000")
    after = w.counters("a1")
    assert 2_000_000 < after["tx_bytes"] - before["tx_bytes"] < 2_200_000
    hosts = w.stats()["hosts"]
    assert hosts["a1"]["sent_bytes"] >= after["tx_bytes"] - before["tx_bytes"]
    assert hosts["n1"]["region"] == "a"


def test_bad_input_is_refused():
    with pytest.raises(ValueError):
        LinkSpec(loss=1.5)
    with pytest.raises(ValueError):
        LinkSpec(rate_mbit=0)
    with pytest.raises(ValueError):
        World({("a", "b"): LinkSpec(), ("b", "a"): LinkSpec(delay_ms=1)})
    w = World({("a", "a"): LinkSpec(), ("b", "b"): LinkSpec()}, prefix="odwbad")
    w.add_host("x", "a")
    with pytest.raises(ValueError, match="no link"):
        w.add_host("y", "b")  # a|b was never described
    with pytest.raises(ValueError):
        w.add_host("x", "a")
    with pytest.raises(ValueError):
        w.add_host("hub", "a")


def test_teardown_leaves_no_namespace_and_no_hub():
    _skip_unless_available()
    prefix = f"odwd{os.getpid()}"
    with World({("a", "a"): LinkSpec()}, prefix=prefix) as w:
        w.add_host("x", "a")
        w.add_host("y", "a", nat=True)
        hub = w.hub_pid
        assert alive(hub) and len(_namespaces(prefix)) == 4  # hub, x, y and y's router
        sleeper = subprocess.Popen(w.exec("x", "sleep", "60"))
        time.sleep(0.2)
        errors = w.teardown()
    sleeper.wait(10)  # a process left inside is ended (and reported)
    assert len(errors) == 1 and str(sleeper.pid) in errors[0], errors
    assert not alive(hub)
    assert not _namespaces(prefix)


ORCHESTRATOR = """
import signal, sys, time, types
# Ctrl-C reaches it as it reaches a user's program: a suite started in the background of a
# non-interactive shell ignores SIGINT, and so did this child (it slept its 60 s, left by atexit)
signal.signal(signal.SIGINT, signal.default_int_handler)
signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
pkg = types.ModuleType("opendiloco")  # skip the package's __init__ (torch): only the world is needed
pkg.__path__ = [sys.argv[1]]
sys.modules["opendiloco"] = pkg
from opendiloco.testing.world import LinkSpec, World
w = World({("a", "a"): LinkSpec()}, prefix=sys.argv[2])
w.add_host("x", "a")
w.add_host("y", "a", nat=True)
w.setup()
print(w.hub_pid, flush=True)
time.sleep(60)
"""


def _orchestrate(prefix: str) -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen([sys.executable, "-c", ORCHESTRATOR, str(ROOT / "opendiloco"), prefix],
                            stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if not line.strip().isdigit():
        proc.kill()
        proc.wait(10)
        pytest.fail(f"the orchestrator did not build its world: {line!r}")
    assert len(_namespaces(prefix)) == 4
    return proc, int(line)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_an_interrupted_orchestrator_tears_its_world_down(sig):
    _skip_unless_available()
    prefix = f"odwi{os.getpid()}"
    proc, hub = _orchestrate(prefix)
    try:
        proc.send_signal(sig)
        # A bound for a hang, not a speed: at the start of the full suite the machine runs every world and
        # swarm test at once, and tearing down namespaces, a NAT router's rules and the hub took over 20 s.
        proc.wait(180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == -sig  # it died of the signal, after tearing down: not its own end, 60 s on
    assert not _namespaces(prefix)
    assert not alive(hub)


def test_a_killed_orchestrators_world_is_cleaned_up_later():
    _skip_unless_available()
    prefix = f"odwk{os.getpid()}"
    proc, hub = _orchestrate(prefix)
    proc.kill()
    proc.wait(10)
    deadline = time.monotonic() + 10
    while alive(hub) and time.monotonic() < deadline:  # the hub dies with its parent
        time.sleep(0.05)
    assert not alive(hub)
    assert len(_namespaces(prefix)) == 4
    assert cleanup_stale(f"{prefix}x") == []  # another prefix: not touched
    assert sorted(cleanup_stale(prefix)) == sorted(f"{prefix}-{n}" for n in ("hub", "x", "y", "y-nat"))
    assert not _namespaces(prefix)
