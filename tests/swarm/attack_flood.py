"""An insider of a closed run (it holds the secret) that floods the announcements of the run's next rounds.

Every junk announcement is a valid one: signed by a fresh identity of its own and sealed with the run's
secret, so that it passes every check a record read from the DHT or pushed passes. The script stores
``--count`` of them under each of the run's next ``--rounds`` round keys in the DHT and pushes them to
each of ``--targets`` (``--mode both``; or only one of the two), for every round the run reaches, for ``--duration``
seconds, and writes what it did to ``--out`` (JSON; as it goes, and at the end).

``junk`` is also what the tests use to make such records without a process.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import threading
import time

from opendiloco.swarm.pushed_records import PushedRecord
from opendiloco.swarm.records import RunRecords
from opendiloco.swarm.signing import Identity


def junk(book: RunRecords, key: str, count: int, expiration: float, identities: list[Identity] | None = None,
         ) -> list[PushedRecord]:
    """``count`` valid announcements under ``key``, each from a fresh identity (or from ``identities``)."""
    identities = identities or [Identity.fresh() for _ in range(count)]
    value = {"attempt": 0, "numel": 10, "codec": "fp16", "part": 1 << 18, "config": "", "since": expiration - 60}
    out = []
    for identity in identities[:count]:
        writer = RunRecords(book.dht, book.membership, identity)
        out.append(PushedRecord(key, identity.peer_id, expiration, writer._envelope(key, value, expiration)))
    return out


async def main_async(args) -> dict:
    import attacker  # tests/swarm/attacker.py: this script's own folder is on the path
    from hivemind.utils.timed_storage import get_dht_time

    from opendiloco.comm.base import RoundKey
    from opendiloco.comm.wire import Code
    from opendiloco.swarm.membership import Membership, RunSecret
    from opendiloco.swarm.pushed_records import MAX_PUSH_RECORDS, encode_push
    from opendiloco.swarm.streams import P2PStreams

    dht, p2p = await attacker.join(args.peers_file)
    membership = Membership(args.run_id, RunSecret.from_environment())
    book = RunRecords(dht, membership, dht.identity)
    streams = P2PStreams(p2p, f"opendiloco.{membership.namespace}.match", membership=membership)
    identities = [Identity.fresh() for _ in range(args.count)]
    report = {"stored": 0, "pushed": 0, "errors": 0, "keys": []}
    deadline, flooded = time.monotonic() + args.duration, {}
    # A test stops it with SIGTERM, at once: storing 511 records under one key can outlast the test's
    # bound on a loaded machine (the report is written after each key, so nothing it did is lost). The
    # handler runs even while a store blocks this thread on a full pipe to the DHT process (the event
    # loop's own signal handling would wait for it): it ends the stores and cancels the flood.
    stopping, loop, flood = threading.Event(), asyncio.get_running_loop(), asyncio.current_task()

    def on_sigterm(*_):
        stopping.set()
        loop.call_soon_threadsafe(flood.cancel)

    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        while time.monotonic() < deadline:
            # Blocking calls run in threads, so that SIGTERM's cancel reaches this loop at once.
            steps = [r.outer_step for r in (await asyncio.to_thread(book.read_workers)).values()]
            print(f"the run's outer steps: {sorted(steps)}", file=sys.stderr, flush=True)
            first = max(steps, default=0) + 1
            for step in range(first, first + args.rounds):
                key = book.round_key(RoundKey(step))
                if key in flooded and flooded[key] > get_dht_time() + 10:
                    continue  # flooded already, and its junk lives on
                exp = get_dht_time() + 60
                flooded[key] = exp
                records = await asyncio.to_thread(junk, book, key, args.count, exp, identities)
                for target in args.targets if args.mode in ("push", "both") else ():  # pushes first: they are quick
                    for i in range(0, len(records), MAX_PUSH_RECORDS):  # a stream carries one push
                        try:
                            stream = await asyncio.wait_for(streams.connect(target), 10)
                            try:
                                opening = {"key": str(RoundKey(step)), "attempt": 0}
                                push = encode_push(records[i:i + MAX_PUSH_RECORDS])
                                await asyncio.wait_for(stream.send(Code.GROUP, opening, push), 10)
                                report["pushed"] += len(records[i:i + MAX_PUSH_RECORDS])
                            finally:
                                stream.close()
                        except Exception:
                            report["errors"] += 1
                if args.mode in ("dht", "both"):
                    stores = []
                    for r in records:
                        if stopping.is_set():
                            break
                        stores.append(asyncio.wrap_future(dht.store(
                            r.key, r.envelope, r.expiration_time, subkey=r.subkey, return_future=True)))
                    answers = await asyncio.gather(*stores, return_exceptions=True)
                    report["stored"] += sum(a is True for a in answers)
                    report["errors"] += sum(isinstance(a, BaseException) for a in answers)
                report["keys"].append(step)
                print(f"flooded round {step}: {report}", file=sys.stderr, flush=True)
                with open(args.out + ".tmp", "w") as f:  # progress, for a test to wait on
                    json.dump(report, f)
                os.replace(args.out + ".tmp", args.out)
            await asyncio.sleep(0.2)
    except asyncio.CancelledError:
        pass
    await attacker.leave(dht, p2p)
    return report


def main():
    import attacker

    p = attacker.insider_arguments()
    p.add_argument("--count", type=int, default=511)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--mode", choices=("dht", "push", "both"), default="both")
    p.add_argument("--targets", nargs="*", default=[])
    p.add_argument("--duration", type=float, default=30.0)
    attacker.run(main_async, p)


if __name__ == "__main__":
    main()
