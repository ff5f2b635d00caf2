"""How long a joiner takes to download the state: from one donor, and in parts from three.

Four emulated hosts (network namespaces on a bridge, ``opendiloco.testing.netns``): three donors whose
links are shaped to ``--donor-mbit`` each, and a joiner shaped to ``--joiner-mbit``. Every donor
serves the same state (θ_global and an outer momentum of ``--params`` values each, as a run's
members hold it) through a real ``StateServer`` on its own p2p daemon. The joiner downloads it in
turns, ``--repeats`` times each: whole from one donor (``fetch_state``, the old way), and in parts
from all three (``fetch_from_donors``). Figures: seconds, and each as a ratio to the state's size
over the joiner's link rate (the least it can take).

    python -m benchmarks.join --params 10000000 --donor-mbit 100 --joiner-mbit 300 --repeats 3

Needs root (network namespaces).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from opendiloco.testing.netns import Hosts, unavailable_reason

PROTOCOL = "bench.state"


def bench_state(params: int) -> dict:
    g = torch.Generator().manual_seed(0)
    return {"outer_step": 1, "inner_steps_total": 10, "local_step": 0,
            "outer": {"global_params": [torch.randn(params, generator=g)],
                      "optimizer": {"state": {0: {"momentum_buffer": torch.randn(params, generator=g)}},
                                    "param_groups": [{"lr": 0.4, "momentum": 0.9, "params": [0]}]}}}


async def donor(ip: str, params: int, out: Path) -> None:
    from hivemind.p2p import P2P

    from opendiloco.swarm import state_transfer
    from opendiloco.swarm.streams import P2PStreams

    state_transfer.SERVES_PER_PEER = 10 ** 6  # the benchmark asks the same donors again and again
    state = bench_state(params)
    p2p = await P2P.create(host_maddrs=[f"/ip4/{ip}/tcp/0"])
    server = state_transfer.StateServer(P2PStreams(p2p, PROTOCOL))
    server.provider = lambda: state
    await server.listen()
    maddrs = [str(m) for m in await p2p.get_visible_maddrs()]
    out.write_text(json.dumps({"peer": p2p.peer_id.to_base58(), "maddrs": maddrs}))
    await asyncio.sleep(3600)


async def joiner(ip: str, donors: list[dict], params: int, repeats: int, out: Path) -> None:
    from hivemind.p2p import P2P

    from opendiloco.swarm import state_transfer
    from opendiloco.swarm.multi_donor import fetch_from_donors
    from opendiloco.swarm.streams import P2PStreams

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    p2p = await P2P.create(host_maddrs=[f"/ip4/{ip}/tcp/0"],
                           initial_peers=[m for d in donors for m in d["maddrs"]])
    streams = P2PStreams(p2p, PROTOCOL)
    peers = [d["peer"] for d in donors]
    bound = 16 * params + (16 << 20)  # what DiLoCoOptimizer.shareable_state_bound allows a model of this size
    results: dict[str, list[float]] = {"one donor": [], "three donors": []}
    size = 0
    for _ in range(repeats):
        t0 = time.perf_counter()
        state = await state_transfer.fetch_state(streams, peers[0], None, bound)
        results["one donor"].append(time.perf_counter() - t0)
        size = sum(t.numel() * t.element_size() for t in (state["outer"]["global_params"][0],
                                                          state["outer"]["optimizer"]["state"][0]["momentum_buffer"]))
        t0 = time.perf_counter()
        got, rates = await fetch_from_donors(streams, peers, 1, bound)
        results["three donors"].append(time.perf_counter() - t0)
        assert torch.equal(got["outer"]["global_params"][0], state["outer"]["global_params"][0])
    out.write_text(json.dumps({"results": results, "state_bytes": size}))
    await p2p.shutdown()


def run(args) -> dict:
    reason = unavailable_reason()
    if reason:
        sys.exit(f"error: {reason}")
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    procs: list[subprocess.Popen] = []
    with Hosts(4, subnet="10.211.0") as hosts:
        hosts.shape(0, args.joiner_mbit)
        for i in (1, 2, 3):
            hosts.shape(i, args.donor_mbit)
        try:
            for i in (1, 2, 3):
                cmd = hosts.exec(i, sys.executable, "-m", "benchmarks.join", "--role", "donor", "--ip", hosts.ip_of(i),
                                 "--params", str(args.params), "--out", str(work / f"donor{i}.json"))
                procs.append(subprocess.Popen(cmd, stderr=subprocess.DEVNULL))
            deadline = time.monotonic() + 120
            while not all((work / f"donor{i}.json").exists() for i in (1, 2, 3)):
                if time.monotonic() > deadline:
                    raise RuntimeError("donors did not start within 120s")
                time.sleep(0.2)
            donors = [json.loads((work / f"donor{i}.json").read_text()) for i in (1, 2, 3)]
            (work / "donors.json").write_text(json.dumps(donors))
            cmd = hosts.exec(0, sys.executable, "-m", "benchmarks.join", "--role", "joiner", "--ip", hosts.ip_of(0),
                             "--repeats", str(args.repeats), "--params", str(args.params),
                             "--donors", str(work / "donors.json"), "--out", str(work / "joiner.json"))
            subprocess.run(cmd, check=True, timeout=1800)
        finally:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
    data = json.loads((work / "joiner.json").read_text())
    floor = data["state_bytes"] * 8 / (args.joiner_mbit * 1e6)
    print(f"state {data['state_bytes'] / 1e6:.1f} MB; donors {args.donor_mbit} Mbit/s each, joiner {args.joiner_mbit} "
          f"Mbit/s: state / joiner's link = {floor:.2f} s")
    print("| download | seconds (each run) | median | / (state / joiner's link) |")
    print("|---|---|---|---|")
    for name, times in data["results"].items():
        med = statistics.median(times)
        print(f"| {name} | {', '.join(f'{t:.2f}' for t in times)} | {med:.2f} | {med / floor:.2f}x |")
    return data


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--params", type=int, default=10_000_000, help="values in θ_global (and in the momentum)")
    p.add_argument("--donor-mbit", type=float, default=100)
    p.add_argument("--joiner-mbit", type=float, default=300)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--work", default="/tmp/opendiloco-bench-join")
    p.add_argument("--role", choices=["donor", "joiner"], help=argparse.SUPPRESS)
    p.add_argument("--ip", help=argparse.SUPPRESS)
    p.add_argument("--donors", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.role == "donor":
        asyncio.run(donor(args.ip, args.params, Path(args.out)))
    elif args.role == "joiner":
        asyncio.run(joiner(args.ip, json.loads(Path(args.donors).read_text()), args.params, args.repeats,
                           Path(args.out)))
    else:
        run(args)


if __name__ == "__main__":
    main()
