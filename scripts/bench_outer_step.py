"""The outer step as the training loop sees it, and what a worker's memory costs per parameter.

Two measurements, each against a baseline taken in the same run:

* **swarm**: 3 worker processes and a bootstrap on 127.0.0.1, each training an MLP with
  ``DiLoCoOptimizer`` (AdamW inner, Nesterov outer, fp16 all-reduce) at H=10. Reported: the
  outer step inside ``opt.step()`` (``SyncReport.seconds``, median over workers and outer steps
  after the first), and memory per worker: the PSS of the worker process at 20M parameters minus
  that at 1M, divided by 80 MiB (the 20M model's fp32 weights). The floor is 6x: weights,
  gradients, two Adam moments, θ_global and the outer momentum.
  Measured twice: with glibc's default allocator behaviour, and with the setting the trainer
  applies (``opendiloco.train.allocator``: freed large tensors go back to the OS).
* **single worker, 150M parameters, CPU**: one outer step with no peers (``SingleWorker("fp16")``)
  against its floor: an fp16 encode + decode of the vector plus one pass over θ_global.

    .venv/bin/python scripts/bench_outer_step.py                  # both, ~5 minutes on 2 cores
    .venv/bin/python scripts/bench_outer_step.py --skip-single    # the swarm part only
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def mlp(params: float):
    import torch

    width = int((params / 4) ** 0.5)  # 4 square layers
    layers = []
    for _ in range(4):
        layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
    return torch.nn.Sequential(*layers[:-1]), width


def pss_bytes() -> int:
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    return 0


def run_worker(args) -> int:
    import functools

    import torch

    from opendiloco import DiLoCoOptimizer
    from opendiloco.swarm.communicator import SwarmCommunicator
    from opendiloco.swarm.daemon.node import start_dht
    from opendiloco.swarm.settings import SwarmSettings
    from opendiloco.train.allocator import release_freed_tensors

    torch.set_num_threads(1)
    if args.release_freed:
        release_freed_tensors()
    dht = start_dht(initial_peers=Path(args.peers_file).read_text().split(), host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    comm = SwarmCommunicator(dht, SwarmSettings(run_id=f"outer-{args.params:g}", compression="fp16",
                                                min_group_size=args.world, straggler_wait=120,
                                                matchmaking_timeout=300, allreduce_timeout=300))
    torch.manual_seed(0)
    model, width = mlp(args.params)
    opt = DiLoCoOptimizer(model.parameters(), local_steps=args.local_steps, communicator=comm,
                          inner_optimizer=functools.partial(torch.optim.AdamW, lr=1e-4))
    gen = torch.Generator().manual_seed(args.rank)
    records = []
    try:
        while opt.outer_step < args.outer_steps:
            x = torch.randn(8, width, generator=gen)
            loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            if opt.local_step == 0:
                s = opt.last_sync
                records.append({"ok": s.ok, "seconds": s.seconds, "allreduce_s": s.allreduce_s,
                                "group": s.group_size, "hash": s.global_hash, "extra": {
                                    k: v for k, v in s.extra.items() if isinstance(v, (int, float, str))}})
        out = {"rank": args.rank, "params": sum(p.numel() for p in model.parameters()), "pss": pss_bytes(),
               "syncs": records}
        Path(args.out).write_text(json.dumps(out))
    finally:
        comm.close()
    return 0


def swarm(params: float, world: int, outer_steps: int, local_steps: int, tmp: Path,
          release_freed: bool = False) -> list[dict]:
    from opendiloco.testing.proctree import ProcessGroup, spawn_bootstrap

    group = ProcessGroup(tmp, cwd=ROOT)
    tag = f"{params:g}{'-released' if release_freed else ''}"
    peers_file = tmp / f"peers-{tag}.txt"
    try:
        spawn_bootstrap(group, peers_file, f"bootstrap-{tag}")
        outs = [tmp / f"w{tag}-{r}.json" for r in range(world)]
        procs = [group.spawn([sys.executable, __file__, "--role", "worker", "--rank", str(r), "--world", str(world),
                              "--params", str(params), "--outer-steps", str(outer_steps),
                              "--local-steps", str(local_steps), "--peers-file", str(peers_file),
                              "--out", str(outs[r])] + (["--release-freed"] if release_freed else []),
                             f"w{tag}-{r}") for r in range(world)]
        group.wait(procs, 900)
    finally:
        leaked = group.stop()
        if leaked:
            print(f"warning: killed leftover processes {leaked}", file=sys.stderr)
    return [json.loads(p.read_text()) for p in outs]


def single_worker(params: float) -> dict:
    import torch

    from opendiloco import DiLoCoOptimizer, SingleWorker
    from opendiloco.comm.formats import get_codec

    torch.manual_seed(0)
    model, width = mlp(params)
    opt = DiLoCoOptimizer(model.parameters(), local_steps=1_000_000, communicator=SingleWorker("fp16"))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p), alpha=1e-3)
    times, comm_s = [], []
    for _ in range(5):  # the first rounds fault in the buffers and the outer momentum: steady state is the last 3
        t0 = time.perf_counter()
        report = opt.sync()
        times.append(time.perf_counter() - t0)
        comm_s.append(report.allreduce_s)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1e-4)
    times, comm_s = times[2:], comm_s[2:]
    n = sum(p.numel() for p in model.parameters())
    codec, vec = get_codec("fp16"), torch.randn(n)
    out = torch.zeros(n)
    floor = []
    for _ in range(3):
        t0 = time.perf_counter()
        codec.roundtrip_into(vec, out)
        for g in opt.outer.global_params:  # one pass over θ_global
            g.detach().mul_(1.0)
        floor.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    opt.outer.global_hash()
    hash_s = time.perf_counter() - t0
    return {"params": n, "outer_step_s": statistics.median(times), "communicator_s": statistics.median(comm_s),
            "floor_s": statistics.median(floor), "hash_s": hash_s}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--role", default="main", choices=["main", "worker"], help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--world", type=int, default=3, help="workers in the swarm part (default 3)")
    p.add_argument("--params", type=float, default=20e6, help=argparse.SUPPRESS)
    p.add_argument("--outer-steps", type=int, default=6)
    p.add_argument("--local-steps", type=int, default=10)
    p.add_argument("--peers-file", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    p.add_argument("--single-params", type=float, default=150e6)
    p.add_argument("--skip-single", action="store_true")
    p.add_argument("--release-freed", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--json", default=None, help="also write the results to this file")
    args = p.parse_args()
    if args.role == "worker":
        return run_worker(args)

    import torch

    results = {}
    with tempfile.TemporaryDirectory(prefix="bench-outer-") as tmp_dir:
        tmp = Path(tmp_dir)
        big = swarm(20e6, args.world, args.outer_steps, args.local_steps, tmp)
        small = swarm(1e6, args.world, 2, args.local_steps, tmp)
        # The same, with the trainer's allocator setting (freed large tensors go back to the OS).
        big_r = swarm(20e6, args.world, 2, args.local_steps, tmp, release_freed=True)
        small_r = swarm(1e6, args.world, 2, args.local_steps, tmp, release_freed=True)
    steady = [s for w in big for s in w["syncs"][1:]]
    if not all(s["ok"] and s["group"] == args.world for s in steady):
        print("WARNING: not every outer step had the whole group", file=sys.stderr)
    for i in range(args.outer_steps):
        if len({w["syncs"][i]["hash"] for w in big}) != 1:
            print(f"WARNING: θ_global hashes differ at outer step {i + 1}", file=sys.stderr)
    outer = statistics.median(s["seconds"] for s in steady)
    # Waiting for the last worker to arrive is the workers' skew, not the communicator's cost: per outer
    # step, each worker's wait is max(entered_at) - its own entered_at.
    ready = []
    for i in range(1, args.outer_steps):
        syncs = [w["syncs"][i] for w in big]
        last = max(x["extra"]["entered_at"] for x in syncs)
        ready += [x["seconds"] - (last - x["extra"]["entered_at"]) for x in syncs]
    outer_ready = statistics.median(ready)
    transfer = statistics.median(s["extra"].get("transfer_s", 0.0) for s in steady)
    mm = statistics.median(s["extra"].get("matchmaking_s", 0.0) for s in steady)
    pss = (statistics.median(w["pss"] for w in big) - statistics.median(w["pss"] for w in small))
    pss_r = (statistics.median(w["pss"] for w in big_r) - statistics.median(w["pss"] for w in small_r))
    weights = big[0]["params"] * 4
    results["swarm"] = {"workers": args.world, "params": big[0]["params"], "outer_step_s": outer,
                        "outer_step_all_ready_s": outer_ready,
                        "outer_step_all_s": sorted(s["seconds"] for s in steady),
                        "transfer_s": transfer, "matchmaking_s": mm, "pss_per_fp32_weights": pss / weights,
                        "pss_20m": statistics.median(w["pss"] for w in big),
                        "pss_1m": statistics.median(w["pss"] for w in small),
                        "pss_per_fp32_weights_released": pss_r / weights}
    print(f"# torch {torch.__version__}; {args.world} workers on 127.0.0.1, MLP of {big[0]['params'] / 1e6:.1f}M "
          f"parameters, H={args.local_steps}, fp16")
    print(f"outer step inside opt.step(): {outer:.3f} s (median of {len(steady)}, min "
          f"{min(s['seconds'] for s in steady):.3f}, max {max(s['seconds'] for s in steady):.3f}; matchmaking "
          f"{mm:.3f} s, transfer + confirmation {transfer:.3f} s); without waiting for the last worker to "
          f"arrive: {outer_ready:.3f} s")
    print(f"memory per worker: (PSS at 20M - PSS at 1M) / fp32 weights = {pss / weights:.2f}x with glibc's "
          f"defaults, {pss_r / weights:.2f}x with the trainer's allocator setting (floor 6x)")
    if not args.skip_single:
        single = single_worker(args.single_params)
        results["single"] = single
        print(f"single worker, {single['params'] / 1e6:.0f}M parameters, CPU: outer step {single['outer_step_s']:.3f} s"
              f" (median of the last 3 of 5), of which the communicator {single['communicator_s']:.3f} s; "
              f"fp16 encode+decode + one pass over θ_global {single['floor_s']:.3f} s (outer step / that: "
              f"{single['outer_step_s'] / single['floor_s']:.2f}x, communicator / that: "
              f"{single['communicator_s'] / single['floor_s']:.2f}x); θ_global hash {single['hash_s']:.3f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
