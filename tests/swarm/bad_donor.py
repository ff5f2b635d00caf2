"""A bad state donor for tests: a peer of the run that says it is ahead, then serves its state badly.

``--mode stall``: takes the state request and never answers (a donor on a dead-slow link).
``--mode die``: announces a state, sends its first part, and exits (a donor killed mid-download).
Each state request it takes is written to ``--marker`` first, so the test knows the download began.
"""

import argparse
import asyncio
import os

from hivemind.utils.timed_storage import get_dht_time

from opendiloco.comm.wire import Code
from opendiloco.swarm import records
from opendiloco.swarm.membership import Membership
from opendiloco.swarm.node import start_dht
from opendiloco.swarm.streams import P2PStreams

RECORD_TTL = 4.0


async def serve(args, stream) -> None:
    await stream.recv(max_payload=0, expect=Code.STATE_REQUEST)
    with open(args.marker, "a") as f:
        f.write("request\n")
    if args.mode == "stall":
        await asyncio.sleep(3600)
    size = 4 << 20
    await stream.send(Code.STATE, {"size": size, "outer_step": args.outer_step, "digest": "0" * 64})
    await stream.send(Code.STATE_PART, None, b"\0" * (1 << 20))
    await asyncio.sleep(0.2)
    os._exit(0)  # mid-download; the DHT process and p2pd follow (WorkerBoundDHT)


async def main_async(args) -> None:
    with open(args.peers_file) as f:
        peers = f.read().split()
    dht = start_dht(initial_peers=peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    peer_id = dht.peer_id.to_base58()
    p2p = await dht.replicate_p2p()
    await P2PStreams(p2p, f"opendiloco.{args.run_id}.state").listen(lambda stream: serve(args, stream))
    book = records.RunRecords(dht, Membership.open(args.run_id), dht.identity)
    while True:  # a heartbeat, as a live worker's
        rec = records.WorkerRecord(peer_id=peer_id, outer_step=args.outer_step, inner_step=4 * args.outer_step,
                                   time=get_dht_time(), config=args.config, global_hash="0123456789abcdef")
        await book.store_async(book.workers_key(), rec.to_value(), get_dht_time() + RECORD_TTL)
        with open(args.marker + ".up", "w") as f:
            f.write(peer_id)
        await asyncio.sleep(1.0)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--peers-file", required=True)
    p.add_argument("--run-id", default="opendiloco")
    p.add_argument("--mode", choices=["stall", "die"], required=True)
    p.add_argument("--marker", required=True)
    p.add_argument("--config", default="", help="the config fingerprint to publish")
    p.add_argument("--outer-step", type=int, default=5)
    asyncio.run(main_async(p.parse_args()))


if __name__ == "__main__":
    main()
