"""What the owners' audit costs a round (opendiloco/comm/audit.py): bytes and time, audit on vs off.

Rounds of G members run over in-memory streams (the runner's whole protocol, no network), so the
time figure is the audit's computation (Merkle trees, re-encoding asked chunks, recomputing them)
and one more exchange; the bytes are what each member would put on the wire. The baseline is the
same round with ``audit_chunks = 0``, measured in the same run, alternating. All G members share
one Python thread here, so the audit's extra seconds per member are (on - off) / G.

    python scripts/bench_owner_audit.py [--numel 120000 1000000 10000000] [--group 2 4 8] [--repeat 5]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import torch

from opendiloco.comm.base import RoundKey
from opendiloco.comm.formats import get_codec
from opendiloco.comm.group import DEFAULT_PART_NUMEL, Group
from opendiloco.comm.runner import RoundRunner
from opendiloco.testing.memory import MemoryNetwork


async def one_round(flats, codec: str, result: str | None, chunks: int, tag: str) -> tuple[float, float]:
    """(seconds, bytes per member: sent + received) of one round."""
    members = [f"peer-{i}" for i in range(len(flats))]
    net = MemoryNetwork()
    for m in members:
        net.add(m)
    group = Group(f"bench-{tag}", tuple(members), RoundKey(0))
    runners = [RoundRunner(group, m, f, 1.0, get_codec(codec), part_numel=DEFAULT_PART_NUMEL,
                           result_codec=get_codec(result) if result else None, audit_chunks=chunks, timeout=600)
               for m, f in zip(members, flats)]
    for m, r in zip(members, runners):
        await net.rounds[m].register(r)
    began = time.perf_counter()
    outcomes = await asyncio.gather(*[r.run(net.connector(m)) for m, r in zip(members, runners)])
    seconds = time.perf_counter() - began
    assert all(torch.equal(o.flat, outcomes[0].flat) for o in outcomes)
    per_member = statistics.mean(r.bytes_sent + r.bytes_received for r in runners)
    return seconds, per_member


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--numel", type=int, nargs="+", default=[120_000, 1_000_000, 10_000_000])
    p.add_argument("--group", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--codec", nargs="+", default=["fp16", "int4/fp16"])
    p.add_argument("--chunks", type=int, default=4)
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args()
    torch.manual_seed(0)
    print(f"{'values':>10} {'G':>2} {'codec':>10} {'bytes/member off':>17} {'on':>12} {'bytes x':>8} "
          f"{'s off':>7} {'s on':>7} {'+s/member':>9}")
    for numel in args.numel:
        for g in args.group:
            flats = [torch.randn(numel) for _ in range(g)]
            for spec in args.codec:
                codec, _, result = spec.partition("/")
                times: dict[int, list[float]] = {0: [], args.chunks: []}
                sizes: dict[int, float] = {}
                for r in range(args.repeat):
                    for chunks in (0, args.chunks):  # alternating: the machine's load hits both alike
                        s, b = asyncio.run(one_round(flats, codec, result or None, chunks, f"{r}-{chunks}"))
                        times[chunks].append(s)
                        sizes[chunks] = b
                off, on = statistics.median(times[0]), statistics.median(times[args.chunks])
                print(f"{numel:>10} {g:>2} {spec:>10} {sizes[0]:>17,.0f} {sizes[args.chunks]:>12,.0f} "
                      f"{sizes[args.chunks] / sizes[0]:>8.3f} {off:>7.3f} {on:>7.3f} {(on - off) / g:>9.3f}")


if __name__ == "__main__":
    main()
