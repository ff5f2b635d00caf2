"""An outsider of a closed run (no secret) that floods the run's DHT keys with records of its own.

It cannot name the run's keys (they are in a namespace derived from the secret), but a DHT node that
stores them sees their ids, and hivemind stores by id. Each junk record is an envelope signed by a
fresh identity of the attacker's, with a body it cannot seal: ``--size`` bytes, set to live ``--ttl``
seconds. The script stores ``--count`` of them under ``--key`` (the run's workers key by default, which
the tests can name) and under the run's unsealed ``{run_id}.secrets`` key, and writes to ``--out``
(JSON) how many each DHT node accepted.

``junk`` is also what the tests use to make such records without a process.
"""

from __future__ import annotations

import asyncio
import os

from opendiloco.swarm.pushed_records import PushedRecord
from opendiloco.swarm.signing import Identity


def junk(key: str, count: int, expiration: float, size: int = 512, body: bytes | None = None) -> list[PushedRecord]:
    """``count`` records under ``key``, each signed by a fresh identity, of a ``size``-byte body (random: no
    member's seal) or of ``body``."""
    out = []
    for _ in range(count):
        identity = Identity.fresh()
        value = body if body is not None else os.urandom(size)
        out.append(PushedRecord(key, identity.peer_id, expiration, identity.envelope(key, identity.peer_id,
                                                                                        expiration, value)))
    return out


async def main_async(args) -> dict:
    import attacker  # tests/swarm/attacker.py: this script's own folder is on the path
    import msgpack
    from hivemind.utils.timed_storage import get_dht_time

    dht, p2p = await attacker.join(args.peers_file)
    exp = get_dht_time() + args.ttl
    secrets = f"{args.run_id}.secrets"
    report = {}
    for key, body in ((args.key, None), (secrets, msgpack.packb({"tag": "0" * 16 + "x" * args.size}))):
        if not key:
            continue
        accepted = 0
        for record in junk(key, args.count, exp, args.size, body):
            try:
                accepted += bool(await asyncio.wrap_future(dht.store(
                    record.key, record.envelope, record.expiration_time, subkey=record.subkey, return_future=True)))
            except Exception:
                pass
        report[key] = accepted
    await attacker.leave(dht, p2p)
    return report


def main():
    p = __import__("attacker").arguments()
    p.add_argument("--key", default="")
    p.add_argument("--count", type=int, default=2000)
    p.add_argument("--size", type=int, default=60 << 10)
    p.add_argument("--ttl", type=float, default=10 * 24 * 3600.0)
    __import__("attacker").run(main_async, p)


if __name__ == "__main__":
    main()
