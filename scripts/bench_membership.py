"""What membership and signed records cost: DHT records and stream openings, against plain ones.

    python scripts/bench_membership.py [--n 200]

Two DHT nodes on 127.0.0.1. Records: one worker's progress record stored by one node and read
by the other, ``n`` times: plain hivemind records (the baseline, a DHT pair without our
validator), signed (an open run), signed and sealed (a closed run). Streams: ``n`` openings of a
stream with one request and one answer, without and with the membership proof. Prints each
figure as a ratio of its baseline, measured in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import hivemind
from hivemind.utils.timed_storage import get_dht_time

from opendiloco.comm.wire import Code
from opendiloco.swarm.daemon.node import start_dht, visible_maddrs
from opendiloco.swarm.membership import Membership, RunSecret
from opendiloco.swarm.records import RunRecords, WorkerRecord
from opendiloco.swarm.signing import Identity
from opendiloco.swarm.streams import P2PStreams

LOCAL = ["/ip4/127.0.0.1/tcp/0"]


def per_op_ms(fn, n: int) -> float:
    times = []
    for i in range(n):
        t0 = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def bench_records(n: int) -> dict[str, float]:
    value = WorkerRecord(peer_id="x", outer_step=12, inner_step=600, global_hash="0123456789abcdef",
                         loss=2.5, samples_per_s=1000.0).to_value()
    out = {}
    a = hivemind.DHT(host_maddrs=LOCAL, start=True)
    b = hivemind.DHT(host_maddrs=LOCAL, initial_peers=a.get_visible_maddrs(), start=True)
    try:
        def plain(i):
            key = f"plain.{i}"
            assert a.store(key, value, get_dht_time() + 60, subkey="peer")
            assert b.get(key, latest=True).value["peer"].value == value
        out["plain"] = per_op_ms(plain, n)
    finally:
        b.shutdown()
        a.shutdown()
    a = start_dht(host_maddrs=LOCAL)
    b = start_dht(host_maddrs=LOCAL, initial_peers=visible_maddrs(a))
    try:
        secret = RunSecret(b"0123456789abcdef0123456789abcdef", "bench")
        for name, membership in (("signed", Membership.open("bench")), ("signed+sealed", Membership("bench", secret))):
            writer, reader = RunRecords(a, membership, a.identity), RunRecords(b, membership)

            def signed(i, writer=writer, reader=reader, name=name):
                key = f"{name}.{i}"
                writer.store(key, value, get_dht_time() + 60)
                assert reader.subkey_values(key, 120) == {a.identity.peer_id: value}
            out[name] = per_op_ms(signed, n)
        ident = Identity.fresh()
        out["sign"] = per_op_ms(lambda i: ident.envelope(f"k{i}", ident.peer_id, 1.0, b"x" * 300), n)
    finally:
        b.shutdown()
        a.shutdown()
    return out


async def bench_streams(n: int) -> dict[str, float]:
    a = start_dht(host_maddrs=LOCAL)
    b = start_dht(host_maddrs=LOCAL, initial_peers=visible_maddrs(a))
    pa, pb = await a.replicate_p2p(), await b.replicate_p2p()
    out = {}
    try:
        secret = RunSecret(b"0123456789abcdef0123456789abcdef", "bench")
        for name, membership in (("plain", None), ("with proof", Membership("bench", secret))):
            protocol = f"bench.{name.replace(' ', '-')}"

            async def serve(stream):
                await stream.recv(max_payload=0, expect=Code.STATE_REQUEST)
                await stream.send(Code.STATE, {"size": 1})
                stream.close()

            await P2PStreams(pb, protocol, membership).listen(serve)
            client = P2PStreams(pa, protocol, membership)
            times = []
            for _ in range(n):
                t0 = time.perf_counter()
                stream = await client.connect(b.identity.peer_id)
                await stream.send(Code.STATE_REQUEST, {})
                await stream.recv(max_payload=0, expect=Code.STATE)
                stream.close()
                times.append(time.perf_counter() - t0)
            out[name] = 1e3 * statistics.median(times)
    finally:
        await pa.shutdown()
        await pb.shutdown()
        b.shutdown()
        a.shutdown()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=200)
    args = p.parse_args()
    rec = bench_records(args.n)
    print(f"record store + read, median of {args.n} (ms):")
    for name in ("plain", "signed", "signed+sealed"):
        print(f"  {name:14s} {rec[name]:7.2f}  {rec[name] / rec['plain']:.2f}x")
    print(f"  signing alone  {rec['sign']:7.2f}")
    streams = asyncio.run(bench_streams(args.n))
    print(f"stream open + request + answer, median of {args.n} (ms):")
    for name in ("plain", "with proof"):
        print(f"  {name:14s} {streams[name]:7.2f}  {streams[name] / streams['plain']:.2f}x")


if __name__ == "__main__":
    main()
