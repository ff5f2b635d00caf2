"""What bounded and robust aggregation cost a shard owner, against the plain weighted mean.

The owner combines its members' parts of 256 Ki values as they arrive; this times that step alone
(decoded fp32 parts in, the aggregate out) for a shard of ``--values`` and ``--members`` members.

    python scripts/bench_aggregation.py --values 10e6 --members 4
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from opendiloco.comm.aggregation import Aggregation  # noqa: E402
from opendiloco.comm.group import DEFAULT_PART_NUMEL  # noqa: E402

METHODS = {
    "plain mean (baseline)": Aggregation(clip_ratio=math.inf, max_weight_ratio=math.inf),
    "bounded mean (default)": Aggregation(),
    "centered-clip, 3 iterations": Aggregation("centered-clip"),
}


def time_shard(agg: Aggregation, parts: list[list[torch.Tensor]], weights: list[float]) -> float:
    began = time.perf_counter()
    for members in parts:
        agg.combine(members, weights)
    return time.perf_counter() - began


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--values", type=float, default=10e6, help="values in the owner's shard")
    p.add_argument("--members", type=int, default=4)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    n, g = int(args.values), args.members
    gen = torch.Generator().manual_seed(0)
    parts = [[torch.randn(min(DEFAULT_PART_NUMEL, n - a), generator=gen) for _ in range(g)]
             for a in range(0, n, DEFAULT_PART_NUMEL)]
    weights = [1.0] * g
    results = {}
    for name, agg in METHODS.items():
        time_shard(agg, parts[:2], weights)  # warm up
        results[name] = statistics.median(time_shard(agg, parts, weights) for _ in range(args.repeats))
    base = results["plain mean (baseline)"]
    print(f"owner's shard of {n:,} values, {g} members, {torch.get_num_threads()} torch thread(s)")
    for name, seconds in results.items():
        print(f"  {name:<30} {seconds * 1e3:8.1f} ms  {seconds / base:5.2f}x")
    if args.out:
        args.out.write_text(json.dumps({"values": n, "members": g, "seconds": results,
                                        "ratio": {k: v / base for k, v in results.items()}}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
