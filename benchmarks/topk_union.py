"""Top-k pseudo-gradients: how much do the members' index sets overlap, and what would each way of
averaging them put on the wire?

A top-k format sends, per chunk of ``--chunk`` values, the k largest of a member's contribution with
their indices (SparseLoCo's shape: 64 of every 4096). Two ways to average them in a group of n:

- **in the all-reduce** (reduce-scatter, then all-gather of the results): each member sends each
  shard owner its entries for that shard; the owner sums them over the *union* of the members'
  indices and sends that union back to every member (as indices, or as a bitmap of the chunk once
  that is smaller). A member sends and receives about k + U entries per chunk (U: the union's size).
- **all-gather**: every member sends its k entries to each of the n-1 others, and each sums all of
  them: (n-1)·k entries sent and received per chunk, whatever the overlap.

Which one wins depends on U against n·k: on how much the members' largest values coincide. This
benchmark measures U on real pseudo-gradients: n replicas of the convergence benchmark's 0.2M Llama
train H inner steps from the same θ_global on their own data shards (``InProcessGroup``, fp16
averages), and every round's contributions are captured; the union is computed with error feedback
as a top-k worker would run it (what a member did not send is added to its next contribution).

    python -m benchmarks.topk_union --workers 32 --rounds 6 --densities 8,32,64 --groups 4,8,16,32

Figures: the union's share of a chunk and U / (n·k), per group size and density (the mean over
rounds and over disjoint groups of the 32 replicas), and bytes per value of the pseudo-gradient
each way sends per member (it receives as much), against the dense all-reduce in fp32 (a shard
out and the results back: 8·(n-1)/n bytes per value). Entries cost 12-bit indices and 4-bit values.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

INDEX_BYTES = 1.5
"""12-bit indices within a 4096-value chunk (SparseLoCo's), packed."""
VALUE_BYTES = 0.5
"""4-bit values (the project's e2m1 or int4)."""


def capture(workers: int, rounds: int, h: int, seed: int) -> list[list]:
    """Every round's contributions of ``workers`` replicas (flat fp32 pseudo-gradients)."""
    import torch

    from opendiloco import InProcessGroup

    from .convergence import in_threads, trainers

    captured: dict = {}

    class Capturing(InProcessGroup):
        def _average(self, rank, flat, weight, key, error_out=None):
            captured.setdefault(key.outer_step, {})[rank] = flat.detach().clone()
            return super()._average(rank, flat, weight, key, error_out)

    torch.set_num_threads(1)
    group = Capturing(workers, compression="fp16", timeout=600)
    with tempfile.TemporaryDirectory() as work:
        ts = trainers(workers, Path(work), group.members, h=h, outer_lr=0.4, batch=8, warmup=10,
                      total=h * rounds, eval_batches=1, seed=seed)
        in_threads(lambda t: [t.train_step() for _ in range(h * rounds)], ts)
    return [[captured[step][r] for r in range(workers)] for step in sorted(captured)]


def union_sizes(rounds: list[list], members: list[int], k_per_chunk: int, chunk: int) -> list[float]:
    """Per round, the mean union size per chunk of ``members``' top-k indices, with error feedback."""
    import torch

    residual = {m: torch.zeros_like(rounds[0][m]) for m in members}
    sizes = []
    for contributions in rounds:
        picked = []
        for m in members:
            c = contributions[m] + residual[m]
            n = c.numel() // chunk * chunk  # whole chunks (the tail is under 0.1 % of the values)
            blocks = c[:n].view(-1, chunk)
            idx = blocks.abs().topk(k_per_chunk, dim=1).indices
            mask = torch.zeros_like(blocks, dtype=torch.bool).scatter_(1, idx, True)
            sent = torch.where(mask, blocks, torch.zeros((), dtype=blocks.dtype))
            residual[m] = c.clone()
            residual[m][:n] -= sent.reshape(-1)
            picked.append(mask)
        union = torch.stack(picked).any(dim=0)
        sizes.append(union.sum(dim=1).float().mean().item())
    return sizes


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=32)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--h", type=int, default=30)
    p.add_argument("--chunk", type=int, default=4096)
    p.add_argument("--densities", default="8,32,64", help="1/N of each chunk sent (k = chunk / N)")
    p.add_argument("--groups", default="4,8,16,32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--results", help="write the figures here (JSON)")
    args = p.parse_args(argv)
    began = time.perf_counter()
    rounds = capture(args.workers, args.rounds, args.h, args.seed)
    numel = rounds[0][0].numel()
    print(f"{args.workers} replicas, {len(rounds)} rounds of H={args.h}, {numel} values, "
          f"captured in {time.perf_counter() - began:.0f}s")
    rows = []
    for density in map(int, args.densities.split(",")):
        k = args.chunk // density
        for n in map(int, args.groups.split(",")):
            groups = [list(range(g, g + n)) for g in range(0, args.workers - n + 1, n)]
            sizes = [s for members in groups for s in union_sizes(rounds, members, k, args.chunk)]
            u = statistics.mean(sizes)
            entry = INDEX_BYTES + VALUE_BYTES
            # The union goes back as indices or, once that is smaller, a bitmap of the chunk.
            result = min(u * INDEX_BYTES, args.chunk / 8) + u * VALUE_BYTES
            # per value of the pseudo-gradient, per member: sent (= received)
            allreduce = (n - 1) / n * (k * entry + result) / args.chunk
            gather = (n - 1) * k * entry / args.chunk
            fp32 = (n - 1) / n * 2 * 4  # the dense all-reduce in fp32: a shard out, the results back
            rows.append({"density": density, "k": k, "n": n, "union": u, "union_share": u / args.chunk,
                         "union_over_nk": u / (n * k), "allreduce_bytes_per_value": allreduce,
                         "allgather_bytes_per_value": gather, "fp32_allreduce_bytes_per_value": fp32,
                         "rounds": len(sizes)})
    print("| density | n | union / chunk | union / (n·k) | bytes sent per value: in the all-reduce | "
          "all-gather | fewer than fp32 all-reduce: all-reduce | all-gather |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        fp32 = r["fp32_allreduce_bytes_per_value"]
        print(f"| 1/{r['density']} | {r['n']} | {r['union_share']:.3f} | {r['union_over_nk']:.3f} | "
              f"{r['allreduce_bytes_per_value']:.4f} | {r['allgather_bytes_per_value']:.4f} | "
              f"{fp32 / r['allreduce_bytes_per_value']:.0f}x | {fp32 / r['allgather_bytes_per_value']:.0f}x |")
    if args.results:
        Path(args.results).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
