"""An insider of a two-worker closed run (it holds the secret) that waits for one worker to restart.

While one of the two is away, the other sees one live peer besides itself: this script's. With a fresh
identity, it publishes a progress record one outer step ahead of the run with a poisoned θ_global hash
(``claim``), refreshed every heartbeat for ``--duration`` seconds, once the run's live workers drop below
``--below`` (a restart under way). A worker that counts every record again (its only partner gone, or
its partners forgotten at its own restart) has two votes: its own and this one, and follows it.
Writes to ``--out`` (JSON) when it claimed and what.

``claim`` is also what the tests run.
"""

from __future__ import annotations

import asyncio
import time

from opendiloco.swarm.records import RunRecords, WorkerRecord
from opendiloco.swarm.signing import Identity


def claim(book: RunRecords, outer_step: int, global_hash: str, ttl: float, config: str = "") -> str:
    """Publishes, under a fresh identity, a progress record at ``outer_step`` with ``global_hash``; its peer id."""
    sybil = RunRecords(book.dht, book.membership, Identity.fresh(), clock=book.clock)
    now = book.clock.now()
    record = WorkerRecord(peer_id=sybil.identity.peer_id, outer_step=outer_step, global_hash=global_hash,
                          time=now, config=config)
    sybil.store(sybil.workers_key(), record.to_value(), now + ttl)
    return sybil.identity.peer_id


async def main_async(args) -> dict:
    import attacker  # tests/swarm/attacker.py: this script's own folder is on the path

    from opendiloco.swarm.membership import Membership, RunSecret

    dht, p2p = await attacker.join(args.peers_file)
    book = RunRecords(dht, Membership(args.run_id, RunSecret.from_environment()), dht.identity)
    report = {"claims": []}
    deadline = time.monotonic() + args.duration
    while time.monotonic() < deadline:
        workers = book.read_workers(args.record_ttl + 2)
        if workers and len(workers) < args.below:
            step = max(r.outer_step for r in workers.values()) + 1
            report["claims"].append(claim(book, step, "poisoned", args.record_ttl, args.config))
        await asyncio.sleep(args.record_ttl / 4)
    await attacker.leave(dht, p2p)
    return report


def main():
    import attacker

    p = attacker.insider_arguments()
    p.add_argument("--below", type=int, default=2)
    p.add_argument("--duration", type=float, default=60.0)
    attacker.run(main_async, p)


if __name__ == "__main__":
    main()
