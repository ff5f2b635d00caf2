"""The emulated WAN (``opendiloco/testing/wan.py``) against a plain veth pair, in one run.

    .venv/bin/python -m benchmarks.wan [--json docs/bench_wan.json]

- **Baseline**: two namespaces joined by a veth pair (MTU 1500, and the world's MTU): one TCP
  flow of ``--bytes``, throughput as the receiver sees it (first byte to EOF); UDP echo RTT.
- **Hub, no shaping**: two hosts of one region of a ``World``, for each MTU of ``--mtus``: the
  same flow, as a ratio to the veth baseline; the hub's CPU seconds per GB carried. Then 4 flows
  at once between 4 pairs of hosts (default MTU): what the hub carries in all.
- **Shaped** (two regions; the default MTU and 1500; TCP CUBIC and BBR): 100 Mbit/s alone, with
  50 ms one way, and with 0.5% loss too; one flow and 4 parallel flows between the same two
  hosts: achieved / configured.
- **RTT** with 50 ms one way: measured (median and min of UDP echoes) / configured (100 ms).

Needs root; prints why not otherwise. Every figure comes from this run, on this machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

from opendiloco.testing import probes
from opendiloco.testing.world import DEFAULT_MTU, LinkSpec, World, unavailable_reason

PORT = 5001


def _json(argv: list[str], timeout: float) -> dict:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{argv}: {proc.stderr.strip()}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


class Server:
    """``probes serve`` in a namespace, ended (by PID) on exit."""

    def __init__(self, exec_prefix: list[str]):
        self.proc = subprocess.Popen([*exec_prefix, *probes.command("serve", "--port", str(PORT), "--timeout", "600")],
                                     stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        if '"ready"' not in line:
            self.close()
            raise RuntimeError(f"probe server did not start: {line!r}")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _sends(exec_prefix: list[str], ip: str, size: int, n: int, timeout: float, cc: str | None = None,
           seconds: float | None = None) -> list[dict]:
    argv = [*exec_prefix, *probes.command("send", ip, str(PORT), "--bytes", str(size), "--timeout", "60")]
    argv += ["--cc", cc] if cc else []
    argv += ["--seconds", str(seconds)] if seconds else []
    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(lambda _: _json(argv, timeout), range(n)))


def _mbit(results: list[dict]) -> float:
    """All the bytes over the time from the first byte of any flow to the last byte of all, as the
    receivers saw them (one monotonic clock for every namespace)."""
    seconds = max(r["server"]["last"] for r in results) - min(r["server"]["first"] for r in results)
    return 8 * sum(r["server"]["bytes"] for r in results) / seconds / 1e6


def flows(exec_prefix: list[str], ip: str, size: int, n: int = 1, timeout: float = 300, cc: str | None = None,
          seconds: float | None = None) -> float:
    """Mbit/s of ``n`` parallel TCP flows of ``size`` bytes each (or for ``seconds``) to one server."""
    return _mbit(_sends(exec_prefix, ip, size, n, timeout, cc, seconds))


def rtts(exec_prefix: list[str], ip: str, count: int = 30) -> list[float]:
    out = _json([*exec_prefix, *probes.command("rtt", ip, str(PORT), "--count", str(count), "--interval", "0.02",
                                               "--timeout", "2")], timeout=120)
    return out["rtts_ms"][1:]  # the first one includes ARP


def veth_baseline(prefix: str, mtu: int, size: int) -> dict:
    a, b = f"{prefix}-va", f"{prefix}-vb"
    try:
        for ns in (a, b):
            subprocess.run(["ip", "netns", "add", ns], check=True)
        subprocess.run(["ip", "link", "add", "eth0", "netns", a, "mtu", str(mtu), "type", "veth", "peer", "name",
                        "eth0", "netns", b, "mtu", str(mtu)], check=True)
        for i, ns in enumerate((a, b), start=1):
            subprocess.run(["ip", "-n", ns, "addr", "add", f"10.78.0.{i}/24", "dev", "eth0"], check=True)
            subprocess.run(["ip", "-n", ns, "link", "set", "eth0", "up"], check=True)
            subprocess.run(["ip", "-n", ns, "link", "set", "lo", "up"], check=True)
        with Server(["ip", "netns", "exec", b]):
            client = ["ip", "netns", "exec", a]
            rtt = rtts(client, "10.78.0.2")
            mbit = statistics.median(flows(client, "10.78.0.2", size) for _ in range(3))
        return {"mtu": mtu, "mbit": mbit, "rtt_ms": statistics.median(rtt)}
    finally:
        for ns in (a, b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def hub_unshaped(prefix: str, mtu: int, size: int) -> dict:
    with World({("a", "a"): LinkSpec()}, prefix=f"{prefix}m", mtu=mtu) as world:
        world.add_host("x", "a")
        world.add_host("y", "a")
        with Server(world.exec("y")):
            rtt = rtts(world.exec("x"), world.ip_of("y"))
            cpu0, bytes0 = world.stats()["hub"]["cpu_s"], world.stats()["links"]["a|a"]["bytes"]
            mbit = statistics.median(flows(world.exec("x"), world.ip_of("y"), size) for _ in range(3))
            stats = world.stats()
        carried = stats["links"]["a|a"]["bytes"] - bytes0
        return {"mtu": mtu, "mbit": mbit, "rtt_ms": statistics.median(rtt),
                "hub_cpu_s_per_gb": (stats["hub"]["cpu_s"] - cpu0) / (carried / 1e9),
                "late_ms_mean": stats["hub"]["late_ms_mean"]}


def hub_pairs(prefix: str, pairs: int, size: int) -> dict:
    """``pairs`` flows at once, each between its own two hosts of one region (default MTU)."""
    with World({("a", "a"): LinkSpec()}, prefix=f"{prefix}p") as world:
        for i in range(pairs):
            world.add_host(f"x{i}", "a")
            world.add_host(f"y{i}", "a")
        with ExitStack() as stack:
            for i in range(pairs):
                stack.enter_context(Server(world.exec(f"y{i}")))
            cpu0 = world.stats()["hub"]["cpu_s"]
            with ThreadPoolExecutor(pairs) as pool:
                results = list(pool.map(lambda i: _sends(world.exec(f"x{i}"), world.ip_of(f"y{i}"), size, 1, 300)[0],
                                        range(pairs)))
            stats = world.stats()
    span = max(r["server"]["last"] for r in results) - min(r["server"]["first"] for r in results)
    return {"pairs": pairs, "mbit": _mbit(results), "hub_cpu_share": (stats["hub"]["cpu_s"] - cpu0) / span,
            "late_ms_mean": stats["hub"]["late_ms_mean"]}

SHAPED_SECONDS = 8.0  # a flow stops sending after this long (CUBIC at 0.5% loss and MTU 1500 crawls)
SHAPED = [
    ("100 Mbit/s", LinkSpec(rate_mbit=100)),
    ("100 Mbit/s, 50 ms", LinkSpec(rate_mbit=100, delay_ms=50)),
    ("100 Mbit/s, 50 ms, 0.5% loss", LinkSpec(rate_mbit=100, delay_ms=50, loss=0.005)),
]


def shaped(prefix: str, size: int, mtu: int, cc: str) -> tuple[list[dict], dict]:
    rows = []
    links = {("a", "a"): LinkSpec(), ("b", "b"): LinkSpec(), ("a", "b"): LinkSpec()}
    with World(links, prefix=f"{prefix}s", seed=1, mtu=mtu) as world:
        world.add_host("a1", "a")
        world.add_host("b1", "b")
        client, ip = world.exec("a1"), world.ip_of("b1")
        with Server(world.exec("b1")):
            for name, spec in SHAPED:
                world.set_link("a", "b", spec)
                before = world.stats()["links"]["a|b"]
                one = flows(client, ip, size, cc=cc, seconds=SHAPED_SECONDS)
                four = flows(client, ip, size // 4, n=4, cc=cc, seconds=SHAPED_SECONDS)
                after = world.stats()["links"]["a|b"]
                frames = after["frames"] - before["frames"]
                rows.append({"mtu": mtu, "cc": cc, "link": name, "rate_mbit": spec.rate_mbit, "one_flow_mbit": one,
                             "four_flows_mbit": four,
                             "dropped_loss": after["dropped_loss"] - before["dropped_loss"],
                             "dropped_queue": after["dropped_queue"] - before["dropped_queue"], "frames": frames})
            world.set_link("a", "b", LinkSpec(rate_mbit=100, delay_ms=50))
            rtt = rtts(client, ip, count=40)
    return rows, {"configured_ms": 100.0, "median_ms": statistics.median(rtt), "min_ms": min(rtt)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mtus", type=int, nargs="+", default=[1500, 9000, DEFAULT_MTU, 32000, 65000])
    p.add_argument("--bytes", type=int, default=200_000_000, help="per unshaped flow")
    p.add_argument("--shaped-bytes", type=int, default=40_000_000, help="per shaped run (4 flows share it)")
    p.add_argument("--shaped-mtus", type=int, nargs="+", default=[DEFAULT_MTU, 1500])
    p.add_argument("--congestion", nargs="+", default=["cubic", "bbr"], help="the senders' TCP congestion control")
    p.add_argument("--json", type=Path, default=None, help="write the results here too")
    args = p.parse_args(argv)
    reason = unavailable_reason()
    if reason:
        print(f"skipped: {reason}")
        return 0
    prefix = f"odwb{os.getpid()}"
    started = time.monotonic()
    print(f"load average before: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    veth = [veth_baseline(prefix, mtu, args.bytes) for mtu in sorted({1500, DEFAULT_MTU})]
    base = veth[0]
    print("veth baseline: " + ", ".join(f"MTU {v['mtu']}: {v['mbit']:.0f} Mbit/s, RTT {v['rtt_ms']:.3f} ms"
                                         for v in veth))
    print("\nhub, no shaping (one TCP flow; ratio to the veth pair at MTU 1500):")
    print("| MTU | Mbit/s | / veth | RTT ms | hub CPU s per GB | mean lateness ms |")
    print("|---|---|---|---|---|---|")
    hub = []
    for mtu in args.mtus:
        row = hub_unshaped(prefix, mtu, args.bytes)
        hub.append(row)
        print(f"| {mtu} | {row['mbit']:.0f} | {row['mbit'] / base['mbit']:.3f} | {row['rtt_ms']:.3f} | "
              f"{row['hub_cpu_s_per_gb']:.2f} | {row['late_ms_mean']:.3f} |")
    pairs = hub_pairs(prefix, 4, args.bytes)
    print(f"| {DEFAULT_MTU}, 4 pairs at once | {pairs['mbit']:.0f} (sum) | {pairs['mbit'] / base['mbit']:.3f} | - | "
          f"(hub busy {100 * pairs['hub_cpu_share']:.0f}% of a core) | {pairs['late_ms_mean']:.3f} |")
    print("\nshaped (achieved / configured rate):")
    print("| MTU | TCP | link | 1 flow Mbit/s | / configured | 4 flows Mbit/s | / configured | frames lost | "
          "queue drops |")
    print("|---|---|---|---|---|---|---|---|---|")
    rows, rtt = [], {}
    for cc in args.congestion:
        for mtu in args.shaped_mtus:
            cell_rows, rtt[f"{mtu} {cc}"] = shaped(prefix, args.shaped_bytes, mtu, cc)
            rows += cell_rows
            for r in cell_rows:
                print(f"| {mtu} | {cc} | {r['link']} | {r['one_flow_mbit']:.1f} | "
                      f"{r['one_flow_mbit'] / r['rate_mbit']:.3f} | {r['four_flows_mbit']:.1f} | "
                      f"{r['four_flows_mbit'] / r['rate_mbit']:.3f} | {r['dropped_loss']} | {r['dropped_queue']} |")
    for cell, r in rtt.items():
        print(f"RTT with 50 ms one way (100 Mbit/s), MTU and TCP {cell}: median {r['median_ms']:.2f} ms "
              f"({r['median_ms'] / 100:.3f}x configured), min {r['min_ms']:.2f} ms ({r['min_ms'] / 100:.3f}x)")
    minutes = (time.monotonic() - started) / 60
    print(f"\n{minutes:.1f} minutes; {os.cpu_count()} cores, kernel {platform.release()}, Python "
          f"{platform.python_version()}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"veth": veth, "hub": hub, "pairs": pairs, "shaped": rows, "rtt": rtt,
                                         "minutes": minutes, "cores": os.cpu_count(), "kernel": platform.release()},
                                        indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
