"""What a worker of several processes pays for being one swarm member (gloo on CPU).

Two costs, each against a baseline measured in the same run:

- the hand-off: rank 0 gives the other ranks the round's average (and its header) after each
  outer step; against a one-process worker's whole outer step at the same size (``SingleWorker``
  with fp16, the outer Nesterov update), which every rank does anyway;
- the per-step agreement (the worker's loss and the stop flag, one small all-reduce): against the
  DDP gradient all-reduce of a step of the same processes, on a model of ``--step-params``.

    python scripts/bench_local_ranks.py --sizes 10e6 50e6 --out docs/bench_local_ranks.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from opendiloco import DiLoCoOptimizer  # noqa: E402
from opendiloco.comm import LocalRanks, SingleWorker  # noqa: E402
from opendiloco.comm.base import RoundKey  # noqa: E402


def _median_s(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        fn()
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def _measure_size(comm: LocalRanks, rank: int, n: int, repeats: int) -> dict:
    flat, result = torch.randn(n) * 1e-3, torch.empty(n)
    keys = iter(range(10**6))

    def hand_off():
        comm.start(flat, weight=1.0, key=RoundKey(next(keys)), out=result).wait()

    hand_off()
    entry = {"with_hand_off_s": _median_s(hand_off, repeats)}  # rank 0: its fp16 round trip, then the hand-off
    dist.barrier()
    if rank == 0:
        single = SingleWorker("fp16")
        params = [torch.nn.Parameter(torch.randn(n))]
        opt = DiLoCoOptimizer(params, local_steps=1, communicator=single)

        def outer_step():
            params[0].grad = torch.randn(n) * 1e-3
            opt.step()

        outer_step()
        entry["one_process_outer_step_s"] = _median_s(outer_step, repeats)
        round_trip = _median_s(lambda: single.start(flat, weight=1.0, key=RoundKey(0), out=result).wait(), repeats)
        entry["hand_off_s"] = max(0.0, entry["with_hand_off_s"] - round_trip)
    dist.barrier()
    return entry


def _rank(rank: int, store: str, out: str, sizes: list[int], step_params: int, repeats: int, ranks: int) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=ranks,
                            timeout=datetime.timedelta(seconds=600))
    torch.set_num_threads(1)
    comm = LocalRanks(SingleWorker("fp16") if rank == 0 else None)
    results = {"sizes": {str(n): _measure_size(comm, rank, n, repeats) for n in sizes}}
    model = torch.nn.Linear(step_params // 1024, 1024, bias=False)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    x = torch.randn(8, step_params // 1024)

    def ddp_step():
        ddp(x).sum().backward()

    ddp_step()
    results["ddp_backward_s"] = _median_s(ddp_step, repeats * 4)
    results["agree_step_s"] = _median_s(lambda: comm.agree_step(1.0, False), repeats * 20)
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=float, nargs="+", default=[10e6, 50e6], help="values averaged per outer step")
    p.add_argument("--step-params", type=float, default=1e6, help="parameters of the model of the DDP step")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    args = p.parse_args()
    sizes = [int(s) for s in args.sizes]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp, "results.json")
        mp.start_processes(_rank, args=(str(Path(tmp, "store")), str(out), sizes, int(args.step_params), args.repeats,
                                        args.ranks), nprocs=args.ranks, start_method="spawn", join=True)
        results = json.loads(out.read_text())
    results["ranks"] = args.ranks
    print(f"{args.ranks} processes, gloo on CPU, 1 torch thread each")
    print(f"{'values':>12} {'hand-off':>10} {'1-process outer step':>22} {'ratio':>7}")
    for n, entry in results["sizes"].items():
        ratio = entry["hand_off_s"] / entry["one_process_outer_step_s"]
        entry["ratio"] = ratio
        print(f"{int(n):>12,} {entry['hand_off_s']:>9.3f}s {entry['one_process_outer_step_s']:>21.3f}s {ratio:>6.2f}x")
    results["agree_vs_ddp"] = results["agree_step_s"] / results["ddp_backward_s"]
    print(f"per-step agreement {results['agree_step_s'] * 1e6:.0f} us against a DDP step (forward+backward, "
          f"{args.step_params:.0e} parameters) of {results['ddp_backward_s'] * 1e3:.1f} ms: "
          f"{results['agree_vs_ddp']:.3f}x")
    if args.out:
        args.out.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
