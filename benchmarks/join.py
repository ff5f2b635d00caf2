"""What a join costs: how long a joiner takes to download the state, and how long the old workers wait.

**Download** (the default):

Four emulated hosts (network namespaces on a bridge, ``opendiloco.testing.netns``): three donors whose
links are shaped to ``--donor-mbit`` each, and a joiner shaped to ``--joiner-mbit``. Every donor
serves the same state (θ_global and an outer momentum of ``--params`` values each, as a run's
members hold it) through a real ``StateServer`` on its own p2p daemon. The joiner downloads it in
turns, ``--repeats`` times each: whole from one donor (``fetch_state``, the old way), and in parts
from all three (``fetch_from_donors``). Figures: seconds, and each as a ratio to the state's size
over the joiner's link rate (the least it can take).

    python -m benchmarks.join --params 10000000 --donor-mbit 100 --joiner-mbit 300 --repeats 3

Needs root (network namespaces).

**The old workers' rounds during a join** (``--held``): ``scripts/local_swarm.sh`` starts three
workers on 127.0.0.1 (``--held-config``, with the overrides below), and once each has applied
``--before`` outer steps, ``scripts/join_swarm.sh`` starts a fourth; once it has averaged
``--after`` times with them, everything is stopped. From the workers' ``metrics.jsonl``: the old
workers' seconds between outer steps and in matchmaking, before the join and in the rounds while the
joiner was starting, downloading and making its first round, as ratios to the rounds before.

    python -m benchmarks.join --held --held-dir runs/bench_join_held

``--held-throttle S`` adds ``S`` seconds of sleep to every inner step of every worker (``train.throttle``):
the time an accelerator computes while its host's CPU is free. On one 2-core machine the joiner's
start and a fourth training process otherwise take CPU from the old workers, which machines of
their own would not; with the steps mostly sleep, what is left between outer steps is the round
itself and any wait for the joiner.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
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

    from opendiloco.swarm.state import transfer as state_transfer
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

    from opendiloco.swarm.state import transfer as state_transfer
    from opendiloco.swarm.state.multi_donor import fetch_from_donors
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
        got = (await fetch_from_donors(streams, peers, 1, bound)).state
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


HELD_MODEL = ["--model.hidden-size", "384", "--model.num-layers", "6", "--model.num-heads", "6",
              "--model.intermediate-size", "1024", "--data.seq-len", "64", "--train.batch-size", "4",
              "--train.threads", "1", "--train.total-steps", "1000000", "--train.eval-batches", "1",
              "--optim.local-steps", "10", "--optim.warmup-steps", "2", "--checkpoint.every-outer-steps", "0",
              "--run.log-every", "5"]
"""About 11M parameters (an 86 MB state to download), rounds of a few seconds on 2 cores."""


def _metrics(run_dir: Path, event: str = "outer_step") -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:  # a line being written
            continue
        if record.get("event") == event:
            records.append(record)
    return records


def held(args) -> None:
    """Plays the join on 127.0.0.1 and reports the old workers' rounds around it."""
    root = Path(__file__).resolve().parents[1]
    work = Path(args.held_dir).resolve()
    if work.exists():
        sys.exit(f"error: {work} exists; pass a new --held-dir")
    olds = [work / f"worker-{i}" for i in range(3)]
    joiner_dir = work / "joiner"
    model = [*HELD_MODEL, "--train.throttle", str(args.held_throttle)]
    swarm = subprocess.Popen(["bash", str(root / "scripts/local_swarm.sh"), "-n", "3", "--config", args.held_config,
                              "--run-dir", str(work), "--", *model], cwd=root, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True)
    joiner = None
    try:
        def wait(condition, what: str, timeout: float = 900) -> None:
            deadline = time.monotonic() + timeout
            while not condition():
                if swarm.poll() is not None or (joiner is not None and joiner.poll() is not None):
                    raise RuntimeError(f"a process exited while waiting for {what}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"no {what} within {timeout:.0f}s")
                time.sleep(0.5)

        wait(lambda: all(sum(r["ok"] for r in _metrics(d)) >= args.before for d in olds), "rounds before the join")
        joined_at = time.time()
        (work / "joined_at").write_text(repr(joined_at))
        joiner = subprocess.Popen(["bash", str(root / "scripts/join_swarm.sh"), "--peers-file",
                                   str(work / "bootstrap.addrs"), "--secret-file", str(work / "run.secret"),
                                   "--config", args.held_config, "--run-id", "local", "--run-dir", str(joiner_dir),
                                   "--", *model], cwd=root, stdout=open(work / "logs/joiner.log", "w"),
                                  stderr=subprocess.STDOUT, start_new_session=True)
        wait(lambda: sum(r["ok"] and r["group_size"] == 4 for r in _metrics(joiner_dir)) >= args.after,
             "rounds with the joiner")
    finally:
        for proc in (joiner, swarm):
            if proc is not None and proc.poll() is None:
                proc.terminate()
        for proc in (joiner, swarm):
            if proc is not None:
                try:
                    proc.wait(90)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
    report_held(work)


def report_held(work: Path) -> dict:
    """The old workers' rounds around the join of a run ``held`` played in ``work``."""
    return join_rounds([work / f"worker-{i}" for i in range(3)], work / "joiner",
                       float((work / "joined_at").read_text()), work / "logs/joiner.log")


def report_world(run: Path, joiner: str = "joiner") -> dict:
    """The same table for a world scenario's run (``benchmarks.world``) in which ``joiner`` joins."""
    launched = [e["time"] for e in map(json.loads, (run / "events.jsonl").read_text().splitlines())
                if e.get("kind") == "launch" and e.get("worker") == joiner]
    olds = sorted(d for d in (run / "workers").iterdir() if d.name != joiner)
    return join_rounds(olds, run / "workers" / joiner, launched[0], run / "logs" / f"{joiner}.log")


def join_rounds(olds: list[Path], joiner_dir: Path, joined_at: float, joiner_log: Path) -> dict:
    """The old workers' rounds before the joiner was launched, while it started and downloaded, the first
    with it, and after: seconds between outer steps and in matchmaking."""
    size = len(olds) + 1
    joined = [r for r in _metrics(joiner_dir) if r["ok"] and r["group_size"] == size]
    first_round = min(joined, key=lambda r: r["time"]) if joined else None  # None: it never made one
    first, first_step = (first_round["time"], first_round["outer_step"]) if first_round else (math.inf, math.inf)
    rows = []
    for d in olds:
        records = [r for r in _metrics(d) if r["ok"]]
        for prev, cur in zip(records, records[1:]):
            phase = ("before" if cur["time"] < joined_at else "joining" if cur["outer_step"] < first_step
                     else "first with the joiner" if cur["outer_step"] == first_step else "after")
            rows.append({"worker": d.name, "phase": phase, "interval_s": cur["time"] - prev["time"],
                         "matchmaking_s": cur.get("matchmaking_s") or 0.0, "group_size": cur["group_size"]})
    before = [r for r in rows if r["phase"] == "before"]
    base_interval = statistics.median(r["interval_s"] for r in before)
    base_mm = statistics.median(r["matchmaking_s"] for r in before)
    print(f"old workers' rounds before the join: median {base_interval:.2f} s between outer steps, "
          f"{base_mm:.2f} s in matchmaking ({len(before)} rounds)")
    print("| phase | rounds | seconds between outer steps (max) | / before | matchmaking s (max) | group sizes |")
    print("|---|---|---|---|---|---|")
    for phase in ("before", "joining", "first with the joiner", "after"):
        sel = [r for r in rows if r["phase"] == phase]
        if not sel:
            continue
        top = max(r["interval_s"] for r in sel)
        print(f"| {phase} | {len(sel)} | {statistics.median(r['interval_s'] for r in sel):.2f} ({top:.2f}) | "
              f"{top / base_interval:.2f}x | {statistics.median(r['matchmaking_s'] for r in sel):.2f} "
              f"({max(r['matchmaking_s'] for r in sel):.2f}) | {sorted({r['group_size'] for r in sel})} |")
    starts = _metrics(joiner_dir, "start")
    if starts:
        print(f"joiner: training from outer step {starts[0]['outer_step']} {starts[0]['time'] - joined_at:.1f} s "
              f"after its launch; " + (f"first round with the old workers {first - joined_at:.1f} s after it"
                                       if first_round else "no round with the old workers"))
    for line in joiner_log.read_text().splitlines():
        if "downloaded state" in line or "in parts failed" in line:
            print("joiner:", line.split(": ", 1)[-1])
    return {"rows": rows, "joined_at": joined_at, "first_round": first}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--params", type=int, default=10_000_000, help="values in θ_global (and in the momentum)")
    p.add_argument("--donor-mbit", type=float, default=100)
    p.add_argument("--joiner-mbit", type=float, default=300)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--work", default="/tmp/opendiloco-bench-join")
    p.add_argument("--held", action="store_true", help="measure the old workers' rounds during a join instead")
    p.add_argument("--held-dir", default="runs/bench_join_held")
    p.add_argument("--report-only", action="store_true", help="--held: the table of a run already in --held-dir")
    p.add_argument("--world-run", help="the same table for a world run (benchmarks/scenarios/slowjoin.toml)")
    p.add_argument("--held-config", default="configs/tiny.toml")
    p.add_argument("--held-throttle", type=float, default=0.0,
                   help="--held: seconds of sleep per inner step of every worker (an accelerator's time)")
    p.add_argument("--before", type=int, default=6, help="--held: outer steps each old worker applies first")
    p.add_argument("--after", type=int, default=3, help="--held: rounds the joiner makes with the old workers")
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
    elif args.world_run:
        report_world(Path(args.world_run))
    elif args.held and args.report_only:
        report_held(Path(args.held_dir))
    elif args.held:
        held(args)
    else:
        run(args)


if __name__ == "__main__":
    main()
